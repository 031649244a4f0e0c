"""The engines' released wheels, pinned by version and cached per user, read without importing them.

    python tests/contract/wheels.py fetch      # download what is missing (the Makefile's contract-wheels)
    python tests/contract/wheels.py where      # print each pinned wheel's path

A wheel lands in `${XDG_CACHE_HOME:-~/.cache}/batchknee/wheels/<name>-<version>/` through
`pip download --no-deps --only-binary=:all:`; a warm cache downloads nothing. The directory appears
atomically (download into a sibling, then rename) under a file lock, so parallel runs neither race nor
leave a half-written wheel behind. A version bump is the one line `VERSION` in the engine's module
(batchknee/engines/).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchknee.engines import sglang, vllm

# The engine releases the metric contract is checked against: each engine module's VERSION. Bump
# it there, then `make test-contract` names every metric that moved.
PINNED: dict[str, str] = {"vllm": vllm.VERSION, "sglang": sglang.VERSION}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batchknee" / "wheels"


def wheel_dir(name: str, version: str | None = None) -> Path:
    return cache_root() / f"{name}-{version or PINNED[name]}"


class WheelMissing(Exception):
    """The pinned wheel is not in the cache; the message names the command that fetches it."""


def wheel_path(name: str, version: str | None = None) -> Path:
    """The cached wheel of `name` at its pinned version; never downloads."""
    version = version or PINNED[name]
    found = sorted(wheel_dir(name, version).glob("*.whl"))
    if len(found) != 1:
        raise WheelMissing(
            f"{name}=={version} is not in {wheel_dir(name, version)} "
            f"(found {len(found)} wheels): run `make contract-wheels` (needs the package index once)"
        )
    return found[0]


def fetch(name: str, version: str | None = None, *, python: str = sys.executable) -> tuple[Path, bool]:
    """The wheel's path and whether it was downloaded now."""
    version = version or PINNED[name]
    target = wheel_dir(name, version)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second fetcher waits, then finds the wheel there
        try:
            return wheel_path(name, version), False
        except WheelMissing:
            pass
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-{version}.", dir=target.parent))
        try:
            subprocess.run(
                [
                    python,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--dest",
                    str(staging),
                    f"{name}=={version}",
                ],
                check=True,
            )
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is the user's, readable as usual
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return wheel_path(name, version), True


def main(argv: list[str]) -> int:
    if argv == ["fetch"]:
        for name in PINNED:
            started = time.monotonic()
            path, downloaded = fetch(name)
            how = f"downloaded in {time.monotonic() - started:.1f} s" if downloaded else "cached"
            print(f"contract-wheels: {name}=={PINNED[name]} {how}: {path}")
        return 0
    if argv == ["where"]:
        for name in PINNED:
            print(wheel_path(name))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
