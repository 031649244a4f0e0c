"""`batchknee emulate`: a GPU-free engine pod (see batchknee.emulator.server).

The rest of the command line is the engine's own (an optional engine word — `vllm`, `trtllm`,
`sglang` — and `serve`, the model, vLLM's, trtllm-serve's or SGLang's flags; SGLang's
`-m sglang.launch_server` too) plus the emulator's options; it is parsed by the emulator itself, so that a
pod's args work unchanged and flags the emulator does not model are ignored with a warning.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from batchknee.commands import UsageError, require_extra


def register(subparsers: Any) -> None:
    # prefix_chars that no argument uses: every token, `--flags` included, lands in `argv` and is
    # parsed by the emulator (argparse would reject the engine's flags it does not know).
    parser = subparsers.add_parser(
        "emulate",
        help="a GPU-free vLLM / TensorRT-LLM / SGLang engine with the real /metrics (batchknee emulate --help)",
        add_help=False,
        prefix_chars="\x00",
    )
    parser.add_argument("argv", nargs="*")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    require_extra("demo", "batchknee emulate", ("aiohttp",))
    from batchknee.emulator.engine_args import ENGINES, EngineArgsError, parse_emulator_args

    argv = list(args.argv)
    if argv and argv[0] in ENGINES:  # `batchknee emulate sglang …` = `--engine sglang …`
        argv = ["--engine", argv[0], *argv[1:]]
    try:
        settings = parse_emulator_args(argv)
    except EngineArgsError as error:
        raise UsageError(str(error)) from None
    from batchknee.emulator.server import run_emulator

    sys.stdout.flush()
    return run_emulator(settings)
