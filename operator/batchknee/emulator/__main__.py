"""`python -m batchknee.emulator vllm|trtllm|sglang <engine command line>`: the same as
`python -m batchknee emulate --engine vllm|trtllm|sglang …`, shaped as a test-kubelet runtime prefix
(`runtimes={"vllm": [python, "-m", "batchknee.emulator", "vllm"]}`; SGLang's rendered
`python -m sglang.launch_server …` runs under `runtimes={"python": [..., "sglang"]}`, the
`-m sglang.launch_server` words skipped)."""

from __future__ import annotations

import sys

from batchknee.emulator.engine_args import ENGINES, EngineArgsError, parse_emulator_args


def main(argv: list[str]) -> int:
    if argv and argv[0] in ENGINES:
        argv = ["--engine", argv[0], *argv[1:]]
    try:
        settings = parse_emulator_args(argv)
    except EngineArgsError as error:
        print(f"batchknee emulate: error: {error}", file=sys.stderr)
        return 2
    from batchknee.emulator.server import run_emulator

    return run_emulator(settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
