"""Managed engine flags are replaced, never duplicated; the user's other args are kept in order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchknee.core.engine_args import flag_value, int_flag, strip_flags, trtllm_args, vllm_args

SPELLINGS = ["--max-num-seqs", "--max_num_seqs"]
units = st.sampled_from(
    [["--enable-prefix-caching"], ["--block-size", "16"], ["--dtype", "bfloat16"], ["--trust-remote-code"]]
)


@st.composite
def user_args(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """Args with managed flags sprinkled in between the user's (both forms), and the args without them."""
    kept_units: list[list[str]] = draw(st.lists(units, max_size=6))
    all_units = list(kept_units)
    for _ in range(draw(st.integers(0, 3))):
        spelling = draw(st.sampled_from(SPELLINGS))
        value = str(draw(st.integers(1, 2048)))
        piece = [f"{spelling}={value}"] if draw(st.booleans()) else [spelling, value]
        all_units.insert(draw(st.integers(0, len(all_units))), piece)
    return [a for u in all_units for a in u], [a for u in kept_units for a in u]


@given(user_args(), st.integers(1, 4096))
def test_max_num_seqs_appears_exactly_once_with_the_decided_value(
    case: tuple[list[str], list[str]], n: int
) -> None:
    args, kept = case
    rendered = vllm_args(args, served_model_name="m", tensor_parallel=2, max_num_seqs=n)
    flags = [a for a in rendered if a.split("=")[0] in SPELLINGS]
    assert flags == ["--max-num-seqs"]
    assert int_flag(rendered, "--max-num-seqs") == n
    assert rendered[8:] == kept  # the user's other args, in order, after the managed ones


def test_both_spellings_are_read() -> None:
    assert flag_value(["--max-num-seqs", "64"], "--max-num-seqs") == "64"
    assert flag_value(["--max-num-seqs=32"], "--max-num-seqs") == "32"
    assert flag_value(["--max_num_seqs", "16", "--max-num-seqs=8"], "--max-num-seqs") == "8"
    assert flag_value(["--max-num-seqs"], "--max-num-seqs") is None
    assert int_flag(["--max-num-seqs", "lots"], "--max-num-seqs") is None
    assert strip_flags(["a", "--port=1", "b", "--port", "2", "c"], ["--port"]) == ["a", "b", "c"]


def test_vllm_managed_flags_win() -> None:
    rendered = vllm_args(
        [
            "--tensor-parallel-size",
            "8",
            "--port=9000",
            "--served-model-name",
            "x",
            "--max-num-batched-tokens",
            "16",
        ],
        served_model_name="chat",
        tensor_parallel=2,
        max_num_seqs=64,
        kv_cache_dtype="fp8",
    )
    assert flag_value(rendered, "--tensor-parallel-size") == "2"
    assert flag_value(rendered, "--port") == "8000"
    assert flag_value(rendered, "--served-model-name") == "chat"
    assert flag_value(rendered, "--kv-cache-dtype") == "fp8"
    assert flag_value(rendered, "--max-num-batched-tokens") == "64"  # vLLM refuses fewer than max-num-seqs
    assert rendered.count("--tensor-parallel-size") == 1


def test_trtllm_reads_the_options_file() -> None:
    rendered = trtllm_args(
        ["--max_batch_size", "2048", "--backend", "pytorch", "--tp_size=4"], tensor_parallel=2
    )
    assert flag_value(rendered, "--extra_llm_api_options") == "/etc/batchknee/engine.yaml"
    assert flag_value(rendered, "--tp_size") == "2"
    assert "--max_batch_size" not in rendered and rendered[-2:] == ["--backend", "pytorch"]
