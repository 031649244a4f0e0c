"""Subcommands of the `batchknee` CLI."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# What each optional extra of the distribution adds (pyproject's [project.optional-dependencies]):
# the operator itself needs neither.
EXTRAS = {
    "plot": ("matplotlib",),
    "demo": ("aiohttp", "cryptography", "matplotlib", "openai"),
}


class UsageError(Exception):
    """A user mistake: printed as one line naming the option, exit status 2, no traceback."""


def require_extra(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise a UsageError naming the extra to install when one of its modules (or of `modules`,
    the part of it `what` uses) is missing."""
    needed = EXTRAS[extra] if modules is None else modules
    missing = [module for module in needed if importlib.util.find_spec(module) is None]
    if missing:
        raise UsageError(
            f"{what} needs the {extra} extra: pip install 'batchknee[{extra}]' "
            f"(not installed: {', '.join(missing)})"
        )


def check_output_path(option: str, path: Path) -> None:
    """Raise a UsageError naming `option` when `path` cannot be written: checked before the work
    whose result goes there, not after it."""
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(f"{option}: folder {folder} does not exist; create it or give another path")
    if path.is_dir():
        raise UsageError(f"{option}: {path} is a folder; give a file name")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise UsageError(f"{option}: cannot write {path} (permission denied)")
