"""The flags the operator manages, reads and removes in an engine's command line, against the pinned
release's own parser (its source, read with `ast`): each exists, and every prefix of each is read as
that flag exactly when the release's argparse expands it so (`python tests/contract/options.py vllm`
prints the options)."""

from __future__ import annotations

import re

import pytest
from options import abbreviation_mismatches, serve_options
from wheels import PINNED

from batchknee.engines import sglang, vllm
from batchknee.engines.contract import CommandLine

# What the operator finds in the user's args (in any spelling the engine takes), and the switches it
# only adds or names.
VLLM_FLAGS = (*vllm.MANAGED, *vllm.READ_FLAGS, *vllm.STRIPPED)
SGLANG_FLAGS = (
    *sglang.MANAGED,
    *(a for aliases in sglang.ALIASES.values() for a in aliases),
    *sglang.READ_FLAGS,
)
SWITCHES = {
    "vllm": (vllm.MFU_METRICS_SWITCH,),
    "sglang": (sglang.METRICS_SWITCH, sglang.MFU_METRICS_SWITCH, sglang.DP_ATTENTION_SWITCH),
}
ENGINES = [
    pytest.param("vllm", VLLM_FLAGS, vllm.COMMAND_LINE, id="vllm"),
    pytest.param("sglang", SGLANG_FLAGS, sglang.COMMAND_LINE, id="sglang"),
]


@pytest.mark.parametrize(("engine", "flags", "cli"), ENGINES)
def test_every_flag_the_operator_writes_or_reads_is_the_releases(
    engine: str, flags: tuple[str, ...], cli: CommandLine
) -> None:
    options = serve_options(engine)
    assert len(options) > 100, f"only {len(options)} options read from {engine} {PINNED[engine]}"
    missing = [flag for flag in (*flags, *SWITCHES[engine]) if flag not in options]
    short = [alias for aliases in cli.aliases.values() for alias in aliases if alias not in options]
    assert not missing + short, f"{engine} {PINNED[engine]} has no {missing + short}"


@pytest.mark.parametrize(("engine", "flags", "cli"), ENGINES)
def test_each_abbreviation_is_read_as_the_releases_argparse_reads_it(
    engine: str, flags: tuple[str, ...], cli: CommandLine
) -> None:
    options = serve_options(engine)
    problems = abbreviation_mismatches(options, [flag for flag in flags if flag.startswith("--")], cli)
    stale = sorted(cli.abbreviable - options)
    assert not problems and not stale, "\n".join(
        [
            *problems,
            *(f"{name}: listed as a neighbour, not an option of {engine} {PINNED[engine]}" for name in stale),
        ]
    )


# Caps on requests that are not the running batch: the API server's limit on requests queued.
NOT_BATCH_CAPS = {"--max-num-queued-reqs"}


def test_vllms_limits_on_the_running_batch_are_all_handled() -> None:
    """A release that adds another cap on sequences or requests (as 0.34 added --max-num-active-seqs)
    fails here until the operator manages or removes it, or it is shown not to cap the batch."""
    pattern = r"--max-[a-z-]*(seqs|reqs|requests|running|batch-size)"
    caps = {o for o in serve_options("vllm") if re.fullmatch(pattern, o)}
    assert caps - NOT_BATCH_CAPS == {vllm.KNOB_FLAG, *vllm.STRIPPED}, sorted(caps)
