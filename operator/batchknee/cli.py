"""The `batchknee` command. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from batchknee.commands import UsageError

# A command module exposes `register(subparsers)`, which adds its parser and sets `handler`
# (a function taking the parsed namespace and returning an exit status).
Subparsers = "argparse._SubParsersAction[argparse.ArgumentParser]"
Registrar = Callable[..., None]


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad option is one line on stderr (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _registrars() -> list[Registrar]:
    from batchknee.commands import bench, crd, demo, devcluster, emulate, operator, plan, simulate

    return [
        plan.register,
        simulate.register,
        bench.register,
        emulate.register,
        devcluster.register,
        crd.register,
        operator.register,
        demo.register,
    ]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
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
    try:
        status: int = args.handler(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could still raise
    except UsageError as error:
        print(f"batchknee {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`batchknee plan | head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
        return 128 + signal.SIGPIPE
    return status
