"""Run the `batchknee` CLI in-process for a test: (exit status, stdout, stderr)."""

from __future__ import annotations

import pytest

from batchknee.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return status, out, err
