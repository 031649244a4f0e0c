"""Managed engine flags are replaced, never duplicated; the user's other args are kept in order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchknee.core.engine_args import (
    flag_value,
    float_flag,
    int_flag,
    overridden_flags,
    strip_flags,
    token_count_flag,
    trtllm_args,
    vllm_args,
)
from batchknee.engines import sglang

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


def test_every_spelling_of_a_managed_flag_is_replaced() -> None:
    user = [
        "-tp",
        "2",
        "--max-num-seqs=999",
        "--max_num_seqs",
        "7",
        "--max-num-se",
        "5",
        "-tp=4",
        "--seed",
        "1",
    ]
    rendered = vllm_args(user, served_model_name="m", tensor_parallel=1, max_num_seqs=64)
    assert flag_value(rendered, "--tensor-parallel-size") == "1" and "-tp" not in rendered
    assert not any(a.startswith("-tp") for a in rendered)
    assert int_flag(rendered, "--max-num-seqs") == 64
    assert rendered[8:] == ["--seed", "1"]
    assert flag_value(["-tp", "2"], "--tensor-parallel-size") == "2"
    assert flag_value(["-tp=2"], "--tensor-parallel-size") == "2"
    # ambiguous abbreviations are not ours (vLLM refuses them itself); other flags are kept
    assert strip_flags(["--max-num", "3", "--max-num-batched-tokens", "9"], ["--max-num-seqs"]) == [
        "--max-num", "3", "--max-num-batched-tokens", "9",
    ]  # fmt: skip


def test_the_flags_the_operator_reads_are_read_in_the_abbreviations_the_engine_takes() -> None:
    # unambiguous in vLLM 0.34 and SGLang 0.5.23 (tests/contract checks every prefix against them)
    assert float_flag(["--gpu-memory-util", "0.5"], "--gpu-memory-utilization") == 0.5
    assert float_flag(["--mem-frac=0.7"], "--mem-fraction-static", sglang.COMMAND_LINE) == 0.7
    assert int_flag(["--chunked-prefill", "512"], "--chunked-prefill-size", sglang.COMMAND_LINE) == 512
    # vLLM 0.34's --max-num-scheduled-tokens makes `--max-num-s` ambiguous: argparse refuses it
    assert strip_flags(["--max-num-s", "8"], ["--max-num-seqs"]) == ["--max-num-s", "8"]
    assert strip_flags(["--max-num-se", "8"], ["--max-num-seqs"]) == []


def test_names_mixing_underscores_and_dashes_are_the_flag_vllm_reads() -> None:
    # vLLM's parser turns every underscore in a name into a dash: these are its flags too
    user = ["--max_num-seqs", "999", "--max-num-active_seqs=8", "--tensor_parallel-size", "4", "--seed", "1"]
    rendered = vllm_args(user, served_model_name="m", tensor_parallel=1, max_num_seqs=64)
    assert rendered[8:] == ["--seed", "1"] and int_flag(rendered, "--max-num-seqs") == 64
    assert flag_value(rendered, "--tensor-parallel-size") == "1"
    # only a name is normalised: values that look like one after it are the user's
    assert strip_flags(["--tokenizer", "__port", "-_max_num_seqs"], ["--port", "--max-num-seqs"]) == [
        "--tokenizer", "__port", "-_max_num_seqs",
    ]  # fmt: skip


def test_token_counts_are_read_in_vllms_human_readable_forms() -> None:
    def read(value: str) -> int | None:
        return token_count_flag(["--max-num-batched-tokens", value], "--max-num-batched-tokens")

    assert [read(v) for v in ("2048", "2k", "2K", "0.5m", "1G", "25.6k")] == [
        2048, 2000, 2048, 500_000, 2**30, 25_600,
    ]  # fmt: skip
    assert [read(v) for v in ("1_000", "+2048", " 2k")] == [1000, 2048, 2000]  # what int() takes, as vLLM
    assert [read(v) for v in ("1.5K", "k", "-1", "0", "2x", "")] == [None] * 6  # vLLM refuses these
    # a budget under the batch limit is raised to it whichever way it is written (vLLM refuses to start)
    rendered = vllm_args(
        ["--max-num-batched-tokens", "0.05k"], served_model_name="m", tensor_parallel=1, max_num_seqs=64
    )
    assert rendered[-2:] == ["--max-num-batched-tokens", "64"]
    kept = vllm_args(
        ["--max-num-batched-tokens=2k"], served_model_name="m", tensor_parallel=1, max_num_seqs=64
    )
    assert kept[-1] == "--max-num-batched-tokens=2k"


def test_a_number_past_any_setting_reads_as_none_as_garbage_does() -> None:
    """A 400-digit count is a valid int and `1e400` a float infinity: either overflowed the float math
    it fed (the KV pool, the step budget of the TPOT model) and every reconcile raised."""
    huge = "9" * 400
    assert [token_count_flag(["--n", v], "--n") for v in (huge, huge + "k", huge + "K", "9e400")] == [
        None
    ] * 4
    assert token_count_flag(["--n", str(2**53)], "--n") == 2**53  # 8 PiB of KV memory still reads
    assert [int_flag(["--n", v], "--n") for v in (huge, "-" + huge, str(2**53 + 1))] == [None] * 3
    assert [float_flag(["--f", v], "--f") for v in ("1e400", "inf", "-inf", "nan")] == [None] * 4
    assert float_flag(["--f", "1e300"], "--f") == 1e300


def test_a_valued_flag_without_a_value_never_swallows_the_next_flag() -> None:
    user = ["--enforce-eager", "--max-num-seqs", "--enable-prefix-caching", "--max-num-seqs", "8"]
    assert strip_flags(user, ["--max-num-seqs"]) == ["--enforce-eager", "--enable-prefix-caching"]
    assert flag_value(["--max-num-seqs", "--trust-remote-code"], "--max-num-seqs") is None
    assert flag_value(["--seed", "-1"], "--seed") == "-1"  # a negative number is a value


def test_overridden_flags_name_what_the_user_wrote() -> None:
    user = ["-tp", "2", "--max-num-seqs", "999", "--port=8000", "--dtype", "half"]
    rendered = vllm_args(user, served_model_name="m", tensor_parallel=1, max_num_seqs=64)
    notes = overridden_flags(user, rendered, ["--max-num-seqs", "--tensor-parallel-size", "--port"])
    assert notes == ["--max-num-seqs 999 → 64", "-tp 2 → 1"]  # --port 8000 is what it gets anyway


def test_sglang_managed_flags_are_stripped_in_every_spelling_and_others_pass_through() -> None:
    from batchknee.core.engine_args import sglang_args
    from batchknee.engines import sglang

    user = [
        "--model-path", "a", "--model=b", "--tp", "4", "--tensor-parallel-size=2", "--tp-size", "1",
        "--max-running", "9", "--max-running-requests=7", "--port", "1", "--host=127.0.0.1",
        "--max-total-tokens", "1000", "--chunked-prefill-size", "4096", "--disable-radix-cache",
        "--context-length", "8192",
    ]  # fmt: skip
    rendered = sglang_args(user, model="m", tensor_parallel=2, max_running_requests=64)
    assert rendered == [
        "--model-path", "m", "--max-running-requests", "64", "--tp-size", "2", "--host", "0.0.0.0",
        "--port", "8000", "--enable-metrics", "--max-total-tokens", "1000", "--chunked-prefill-size",
        "4096", "--disable-radix-cache", "--context-length", "8192",
    ]  # fmt: skip
    # `--max` is ambiguous in SGLang's parser (argparse refuses it): not a managed flag, kept as given
    assert strip_flags(["--max", "3"], sglang.MANAGED, sglang.COMMAND_LINE) == ["--max", "3"]
    assert int_flag(["--max-running-req=12"], "--max-running-requests", sglang.COMMAND_LINE) == 12
    # --enable-metrics is never doubled
    assert (
        sglang_args(["--enable-metrics"], model="m", tensor_parallel=1, max_running_requests=1).count(
            "--enable-metrics"
        )
        == 1
    )
