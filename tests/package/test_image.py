"""The image, without a Docker engine: the Dockerfile's steps repeated here.

- the build context is what .dockerignore lets through, and the build stage's COPY lines pick from it;
- the wheel is built from that copy (offline: --no-build-isolation);
- the runtime stage's install: a venv without pip, filled by another pip from wheels only
  (--no-index --find-links; the dependencies come from the wheelhouse `make wheelhouse` fetched);
  the base wheel only — the operator, without the test world or plotting;
- the image's ENV (HOME, TMPDIR under /tmp, PYTHONDONTWRITEBYTECODE, …) with /tmp and
  /opt/batchknee mapped to folders here; then the console script runs, and nothing under the
  installed venv (the image's read-only root) changes; commands that need an extra say which;
- the same wheel plus the `demo` extra in another fresh venv: the demo's entry point and modules
  import and find their data outside the repository.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest
from conftest import PROJECT, ROOT
from packaging.utils import canonicalize_name
from packaging.version import Version
from pinned import pins

from batchknee.settings import OperatorSettings

DOCKERFILE = ROOT / "Dockerfile"
WHEELHOUSE = Path(os.environ.get("BATCHKNEE_WHEELHOUSE", ROOT / ".venv" / "wheelhouse"))
VENV_IN_IMAGE = "/opt/batchknee"


@dataclass
class Stage:
    name: str
    instructions: list[tuple[str, str]]  # (INSTRUCTION, arguments)

    def all(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]


def stages() -> dict[str, Stage]:
    """The Dockerfile's stages by name, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending.strip())
        pending = ""
    found: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            match = re.search(r"\bAS\s+(\S+)$", args, re.IGNORECASE)
            assert match, f"every stage is named: {line}"
            current = found[match.group(1)] = Stage(match.group(1), [])
        elif current is not None:
            current.instructions.append((instruction, args.strip()))
    return found


def image_env() -> dict[str, str]:
    """The runtime stage's ENV instructions."""
    env: dict[str, str] = {}
    for args in stages()["runtime"].all("ENV"):
        for item in shlex.split(args):
            key, _, value = item.partition("=")
            env[key] = value
    return env


# --- the Dockerfile itself -------------------------------------------------------------------------


def test_the_dockerfile_builds_a_wheel_and_installs_it_into_a_slim_runtime() -> None:
    found = stages()
    assert list(found) == ["build", "runtime"]
    text = DOCKERFILE.read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text  # the runtime is a slim Python 3.11
    [wheel] = found["build"].all("RUN")
    assert "pip wheel --wheel-dir /wheels -c constraints.txt ." in wheel  # the tested versions
    [install] = found["runtime"].all("RUN")
    assert "--mount=type=bind,from=build,source=/wheels,target=/wheels" in install
    assert f"python -m venv --without-pip {VENV_IN_IMAGE}" in install
    assert "install --no-index --find-links /wheels batchknee" in install


def test_the_image_runs_as_a_numeric_non_root_user_with_a_read_only_root() -> None:
    runtime = stages()["runtime"]
    [user] = runtime.all("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, user
    assert int(uid) == 65532  # the chart's podSecurityContext.runAsUser
    env = image_env()
    assert env["PYTHONUNBUFFERED"] == "1" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    for writable in ("HOME", "TMPDIR"):
        assert env[writable] == "/tmp" or env[writable].startswith("/tmp/"), writable
    assert runtime.all("WORKDIR") == ["/tmp"]
    assert runtime.all("ENTRYPOINT") == ['["batchknee"]'] and runtime.all("CMD") == ['["operator"]']


def test_the_image_exposes_the_liveness_and_metrics_ports() -> None:
    runtime = stages()["runtime"]
    env = image_env()
    settings = OperatorSettings()
    assert env["BATCHKNEE_HEALTH_PORT"] == str(settings.health_port)
    assert env["BATCHKNEE_METRICS_PORT"] == str(settings.metrics_port)
    assert env["BATCHKNEE_HEALTH_ADDRESS"] == env["BATCHKNEE_METRICS_ADDRESS"] == "0.0.0.0"
    [exposed] = runtime.all("EXPOSE")
    assert set(exposed.split()) == {str(settings.health_port), str(settings.metrics_port)}
    [healthcheck] = runtime.all("HEALTHCHECK")
    assert "/healthz" in healthcheck and "BATCHKNEE_HEALTH_PORT" in healthcheck


# --- the build context and the wheel ---------------------------------------------------------------


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_excludes(relative: str) -> bool:
    """Docker's rule: the last pattern matching the path (or one of its parent folders) wins."""
    excluded = False
    parts = relative.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        regex = _glob_regex(line.lstrip("!").rstrip("/"))
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def build_context(into: Path) -> Path:
    """The build stage's WORKDIR after its COPY lines, from the context .dockerignore lets through."""
    workdir = into / "src"
    workdir.mkdir(parents=True)
    for args in stages()["build"].all("COPY"):
        *sources, dest = shlex.split(args)
        assert not any(s.startswith("--") for s in sources), "no COPY --from in the build stage"
        assert dest.endswith("/"), f"COPY into a folder: {args}"
        folder = workdir / dest
        for source in sources:
            origin = ROOT / source
            if origin.is_file():  # a file: into the folder, under its own name
                assert not dockerignore_excludes(source), f"{source} is excluded by .dockerignore"
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, folder / origin.name)
                continue
            for path in sorted(origin.rglob("*")):  # a folder: its contents, less what is ignored
                relative = path.relative_to(ROOT).as_posix()
                if path.is_file() and not dockerignore_excludes(relative):
                    copy = folder / path.relative_to(origin)
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, copy)
    return workdir


def test_the_dockerignore_keeps_the_context_to_the_sources() -> None:
    for kept in (
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "operator/batchknee/cli.py",
        "operator/batchknee/py.typed",
    ):
        assert not dockerignore_excludes(kept), kept
    for left_out in (
        ".venv/bin/python",
        ".git/config",
        "bin/kube-apiserver",
        "tests/unit/test_render.py",
        "charts/batchknee/values.yaml",
        "operator/batchknee/__pycache__/cli.cpython-311.pyc",
        "operator/batchknee.egg-info/PKG-INFO",
        "Dockerfile",
    ):
        assert dockerignore_excludes(left_out), left_out


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scratch = tmp_path_factory.mktemp("image-build")
    context = build_context(scratch)
    out = scratch / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(out), "."],
        cwd=context, check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    [built] = out.glob("batchknee-*.whl")
    return built


def test_the_wheel_holds_the_package_its_data_and_the_console_script(wheel: Path) -> None:
    assert wheel.name == f"batchknee-{PROJECT['version']}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = f"batchknee-{PROJECT['version']}.dist-info"
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
        metadata = Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
    sources = {
        path.relative_to(ROOT / "operator").as_posix()
        for path in (ROOT / "operator" / "batchknee").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert sources <= names, sorted(sources - names)
    assert "batchknee/py.typed" in names  # package data: type information for users of the API
    manifests = {p.name for p in (ROOT / "operator" / "batchknee" / "demo" / "manifests").glob("*.yaml")}
    assert manifests and {f"batchknee/demo/manifests/{m}" for m in manifests} <= names  # the demo's own
    assert not any(n.startswith(("tests/", "operator/", "charts/")) for n in names)
    assert "[console_scripts]" in entry_points and "batchknee = batchknee.cli:main" in entry_points
    assert metadata["Requires-Python"] == PROJECT["requires-python"]

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    requires = metadata.get_all("Requires-Dist") or []
    assert {name(r) for r in requires if "extra ==" not in r} == {name(r) for r in PROJECT["dependencies"]}
    for extra in ("plot", "demo"):
        assert extra in (metadata.get_all("Provides-Extra") or [])
        assert {name(r) for r in requires if f'extra == "{extra}"' in r} == {
            name(r) for r in PROJECT["optional-dependencies"][extra]
        }
    # The operator's dependencies leave the test world and plotting out.
    assert not {"matplotlib", "cryptography"} & {name(r) for r in PROJECT["dependencies"]}


# --- installed the runtime stage's way, and run ----------------------------------------------------


@dataclass
class Installed:
    venv: Path
    scratch: Path  # the image's /tmp
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*args],
            env=self.env,
            cwd=self.scratch,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        path.relative_to(folder).as_posix(): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in folder.rglob("*")
        if not path.is_dir()
    }


def install(wheel: Path, root: Path, requirement: str) -> Path:
    """A fresh venv without pip under root/opt/batchknee, filled from the wheelhouse only."""
    if not (WHEELHOUSE / ".done").exists():
        pytest.fail(
            f"no wheelhouse at {WHEELHOUSE}: run `make wheelhouse` (it fetches the dependencies' wheels)"
        )
    venv = root / "opt" / "batchknee"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         "--no-index", "--find-links", str(WHEELHOUSE), "--find-links", str(wheel.parent), requirement],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return venv


def site_packages_mb(venv: Path) -> float:
    [site] = venv.glob("lib/python3*/site-packages")
    return sum(p.stat().st_size for p in site.rglob("*") if p.is_file()) / 1e6


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("image")
    venv = install(wheel, root, "batchknee")
    scratch = root / "tmp"
    scratch.mkdir()

    def mapped(value: str) -> str:
        value = re.sub(r"(?<![\w/])/tmp(?=/|$|:)", str(scratch), value)  # first: scratch is under /tmp
        return value.replace("$PATH", "/usr/local/bin:/usr/bin:/bin").replace(VENV_IN_IMAGE, str(venv))

    env = {key: mapped(value) for key, value in image_env().items()}
    env.update(LANG="C.UTF-8", KUBECONFIG=str(scratch / "no-kubeconfig"))
    return Installed(venv, scratch, env)


def test_the_console_script_runs_from_the_fresh_venv(installed: Installed) -> None:
    before = tree(installed.venv)
    assert (installed.venv / "bin" / "batchknee").exists()
    assert not (installed.venv / "bin" / "pip").exists()  # nothing to install with at run time

    where = installed.run("python", "-c", "import batchknee, kopf; print(batchknee.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.venv), where.stdout  # not the checkout

    top = installed.run("batchknee", "--help")
    assert top.returncode == 0, top.stderr
    for command in ("plan", "simulate", "emulate", "operator", "crd"):
        assert command in top.stdout, command
    operator = installed.run("batchknee", "operator", "--help")
    assert operator.returncode == 0, operator.stderr
    assert "BATCHKNEE_PROMETHEUS_URL" in operator.stdout and "--peering" in operator.stdout

    crd = installed.run("batchknee", "crd")
    assert crd.returncode == 0 and crd.stdout == (ROOT / "crds" / "batchknee.io_llmservings.yaml").read_text()

    planned = installed.run(
        "batchknee", "plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--context", "2048"
    )
    assert planned.returncode == 0, planned.stderr
    assert "B_knee" in planned.stdout

    # The image has neither plotting nor the test world: the commands that need them say so.
    lean = installed.run("python", "-c", "import matplotlib")
    assert lean.returncode != 0 and "No module named 'matplotlib'" in lean.stderr
    plot = installed.run(
        "batchknee", "plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--plot", "k.png"
    )
    assert plot.returncode == 2, plot.stderr
    assert "pip install 'batchknee[plot]'" in plot.stderr
    for command in (["demo"], ["dev-cluster", "up"]):
        refused = installed.run("batchknee", *command)
        assert refused.returncode == 2, refused.stderr
        assert f"batchknee {command[0]} needs the demo extra: pip install 'batchknee[demo]'" in refused.stderr
        assert "Traceback" not in refused.stderr

    assert tree(installed.venv) == before, (
        "the run wrote under the installed venv (the image's read-only root)"
    )
    assert not list(installed.venv.rglob("__pycache__/*.cpython-*.pyc.*"))


def test_the_image_holds_the_pinned_version_of_every_dependency(installed: Installed) -> None:
    """The wheelhouse was fetched with constraints.txt as the Dockerfile's build stage fetches: each
    distribution in the fresh venv but batchknee is one the tests ran with, at that version."""
    listed = installed.run(
        "python", "-c",
        "import json, importlib.metadata as m; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    found = {canonicalize_name(name): Version(version) for name, version in json.loads(listed.stdout).items()}
    assert found.pop(canonicalize_name("batchknee")) == Version(PROJECT["version"])
    assert {"kopf", "kubernetes", "pydantic", "prometheus-api-client"} <= found.keys()
    pinned = pins()
    differing = {
        name: f"installed {version}, pinned {pinned.get(name, 'nothing')}"
        for name, version in found.items()
        if pinned.get(name) != version
    }
    assert not differing, f"{differing}: `make lock` re-pins, `make wheelhouse` fetches the pins"


def test_the_demo_extra_runs_the_demo_entry_point_outside_the_repository(
    wheel: Path, installed: Installed, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("demo-extra")
    venv = install(wheel, root, "batchknee[demo]")
    scratch = root / "tmp"
    scratch.mkdir()
    env = {**installed.env, "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "VIRTUAL_ENV": str(venv)}
    env.update(HOME=str(scratch), TMPDIR=str(scratch), MPLCONFIGDIR=str(scratch / "matplotlib"))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*args], env=env, cwd=scratch, capture_output=True, text=True, timeout=120, check=False
        )

    helped = run("batchknee", "demo", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--fast" in helped.stdout
    probe = (
        "import json, batchknee\n"
        "from batchknee.demo.run import default_examples, run_scenario\n"
        "from batchknee.demo.world import DemoWorld\n"
        "from batchknee.demo.timeline import plot\n"
        "import batchknee.devcluster.pki, batchknee.devcluster.kubelet\n"
        "from batchknee.emulator.server import EmulatorServer\n"
        "from batchknee.api.crd import crd_yaml\n"
        "print(json.dumps({'package': batchknee.__file__, 'examples': [str(p) for p in default_examples()],\n"
        "                  'crd': crd_yaml()}))\n"
    )
    imported = run("python", "-c", probe)
    assert imported.returncode == 0, imported.stderr
    found = json.loads(imported.stdout)
    assert Path(found["package"]).is_relative_to(venv)
    for example in map(Path, found["examples"]):
        assert example.is_relative_to(venv) and example.is_file(), example  # package data, not the checkout
        assert "kind: LLMServing" in example.read_text()
    assert found["crd"] == (ROOT / "crds" / "batchknee.io_llmservings.yaml").read_text()

    # Plotting works with the extra; matplotlib's cache goes to MPLCONFIGDIR, not next to the code.
    knee = scratch / "knee.png"
    planned = run("batchknee", "plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--plot", str(knee))
    assert planned.returncode == 0, planned.stderr
    assert knee.stat().st_size > 0

    # A proxy for the image size (no Docker here): what each install puts in site-packages.
    print(
        f"\nsite-packages: base {site_packages_mb(installed.venv):.0f} MB, "
        f"with the demo extra {site_packages_mb(venv):.0f} MB"
    )
