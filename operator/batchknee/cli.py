"""The `batchknee` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

# A command module exposes `register(subparsers)`, which adds its parser and sets `handler`
# (a function taking the parsed namespace and returning an exit status).
Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _registrars() -> list[Registrar]:
    from batchknee.commands import devcluster, plan

    return [plan.register, devcluster.register]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchknee",
        description="Keep LLM engines' decode batch limit at the memory-bandwidth knee.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in _registrars():
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    status: int = args.handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
