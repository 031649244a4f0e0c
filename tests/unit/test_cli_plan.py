"""`batchknee plan`: the table, the JSON contract, the plot and every user error path."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import run

SEED = ["plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--params", "8.0e9", "--bandwidth", "2.0TB/s"]


def test_json_contract_reproduces_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, *SEED, "--context", "512,2048,8192", "--batch", "1,8,32,64,128,256", "--output", "json"
    )
    assert status == 0
    plans = json.loads(out)
    assert [p["contextLength"] for p in plans] == [512, 2048, 8192]
    assert [round(p["bKnee"]) for p in plans] == [238, 60, 15]
    assert [p["recommendedMaxNumSeqs"] for p in plans] == [240, 64, 16]
    assert [p["recommendedMaxTokens"] for p in plans] == [240 * 512, 64 * 2048, 16 * 8192]
    assert plans[1]["modelBytes"] == 16e9 and plans[1]["kvBytesPerToken"] == 131072
    assert plans[1]["kvBytesPerSeq"] == 131072 * 2048
    rows = {r["batch"]: r for r in plans[1]["rows"]}
    assert round(rows[32]["tpotMs"], 1) == 12.3 and round(rows[64]["tpotMs"], 1) == 16.6
    assert int(rows[32]["tokensPerSecond"]) == 2602 and int(rows[64]["tokensPerSecond"]) == 3857


def test_table_shows_knee_recommendation_and_changes(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, *SEED, "--context", "2048")
    assert status == 0
    assert "B_knee 59.6" in out
    assert "recommended --max-num-seqs 64" in out
    assert "KV at that batch 131,072 tokens" in out
    row_64 = next(line for line in out.splitlines() if line.split()[:1] == ["64"])
    assert row_64.split()[:5] == ["64", "16.6", "+35%", "3,858", "+48%"]


def test_catalog_parameters_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        "plan",
        "--model",
        "meta-llama/Meta-Llama-3-70B",
        "--gpu",
        "h100-sxm",
        "--tp",
        "4",
        "--context",
        "2048",
        "--kv-dtype",
        "fp8",
        "--tpot-target-ms",
        "25",
        "--overhead-ms",
        "2",
        "--bandwidth-efficiency",
        "0.8",
        "--prefix-sharing",
        "0.5",
        "--knee-factor",
        "1.2",
        "--output",
        "json",
    )
    assert status == 0
    [plan] = json.loads(out)
    assert plan["kvBytesPerToken"] == 327680 / 4 / 2
    assert plan["recommendedMaxNumSeqs"] <= plan["sloBatch"] or plan["limitedBy"] != "tpot-target"


def test_model_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
            }
        )
    )
    status, out, _ = run(
        capsys,
        "plan",
        "--model-config",
        str(config),
        "--gpu",
        "a100",
        "--context",
        "2048",
        "--output",
        "json",
    )
    assert status == 0
    assert json.loads(out)[0]["bKnee"] == pytest.approx(59.8, abs=0.1)


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "knee.png"
    status, _, _ = run(capsys, *SEED, "--plot", str(path))
    assert status == 0
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 600 and height > 300


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "llama-3-7b", "--gpu", "a100"],
            "--model: unknown model 'llama-3-7b' (closest: llama-3-70b",
        ),
        (["--model", "llama-3-8b", "--gpu", "a1000"], "--gpu: unknown GPU 'a1000' (closest: "),
        (["--gpu", "a100"], "--model: give a catalog model name, or --model-config PATH"),
        (
            ["--model", "llama-3-8b", "--gpu", "a100", "--context", "0"],
            "argument --context: '0' must be positive",
        ),
        (
            ["--model", "llama-3-8b", "--gpu", "a100", "--context", "2k"],
            "argument --context: '2k' is not a whole number",
        ),
        (
            ["--model", "llama-3-8b", "--gpu", "a100", "--bandwidth", "2XB/s"],
            "argument --bandwidth: '2XB/s' is not",
        ),
        (["--model", "llama-3-8b", "--gpu", "a100", "--bandwidth", "-1TB/s"], "argument --bandwidth:"),
        (
            ["--model", "llama-3-8b", "--gpu", "a100", "--params", "nan"],
            "argument --params: 'nan' must be a positive finite number",
        ),
        (
            ["--model", "llama-3-8b", "--gpu", "a100", "--kv-dtype", "fp4"],
            "argument --kv-dtype: invalid choice",
        ),
        (
            ["--model", "llama-3-8b", "--gpu", "a100", "--weight-dtype", "q4"],
            "argument --weight-dtype: invalid choice",
        ),
        (["--model", "llama-3-8b", "--gpu", "a100", "--prefix-sharing", "1"], "argument --prefix-sharing:"),
        (
            ["--model", "llama-3-8b", "--gpu", "a100", "--bandwidth-efficiency", "1.5"],
            "argument --bandwidth-efficiency",
        ),
        (
            ["--model", "llama-3-8b", "--gpu", "a100", "--model-config", "/nonexistent.json"],
            "--model-config: cannot read",
        ),
    ],
)
def test_user_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = run(capsys, "plan", *argv)
    assert status == 2
    assert out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_console_script_runs_without_a_traceback_on_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "batchknee", "plan", "--model", "nope", "--gpu", "a100"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("batchknee plan: error: --model: unknown model 'nope'")


def test_goal_slo_runs_the_p99_bound_past_the_knee(capsys: pytest.CaptureFixture[str]) -> None:
    common = [
        "--model",
        "llama-3-8b",
        "--gpu",
        "a100-80gb",
        "--overhead-ms",
        "2",
        "--bandwidth-efficiency",
        "0.8",
    ]
    args = ["plan", *common, "--context", "2048", "--tpot-target-ms", "30", "--output", "json"]
    status, out, _ = run(capsys, *args, "--goal", "slo")
    assert status == 0
    [plan] = json.loads(out)
    assert plan["limitedBy"] == "tpot-target" and plan["recommendedMaxNumSeqs"] > 64  # past the knee
    assert plan["recommendedMaxNumSeqs"] <= plan["sloBatch"]
    row = {r["batch"]: r for r in plan["rows"]}[64]
    assert row["tpotP99Ms"] > row["tpotMs"]  # the prefill chunks' tail
    status, _, err = run(capsys, "plan", *common, "--context", "2048", "--goal", "slo")
    assert status == 2 and "--goal slo: needs --tpot-target-ms" in err
    # no margin, as spec.tuning.sloMarginPercent 0 takes (was: refused): a larger batch
    status, out, _ = run(capsys, *args, "--goal", "slo", "--slo-margin-percent", "0")
    assert status == 0 and json.loads(out)[0]["recommendedMaxNumSeqs"] > plan["recommendedMaxNumSeqs"]


def test_sglang_plan_names_its_knob_and_its_own_default(capsys: pytest.CaptureFixture[str]) -> None:
    from batchknee.engines import sglang

    status, out, _ = run(capsys, *SEED, "--engine", "sglang", "--context", "2048,8192")
    assert status == 0
    assert "recommended --max-running-requests 64" in out and "--max-num-seqs" not in out
    # the pool SGLang would size at its --mem-fraction-static, and the batch limit it derives from it
    pool = (80 * 1024**3 * sglang.DEFAULT_MEM_FRACTION_STATIC - 16e9 - 1024**3) / 131072
    line = next(line for line in out.splitlines() if line.startswith("SGLang's own pick"))
    assert f"{sglang.default_max_running_requests(int(pool), 8192)} (KV pool" in line


def test_sglang_shared_prefix_raises_the_knee(capsys: pytest.CaptureFixture[str]) -> None:
    def knee(*extra: str) -> float:
        status, out, _ = run(
            capsys, *SEED, "--engine", "sglang", "--context", "4096", "--output", "json", *extra
        )
        assert status == 0
        return float(json.loads(out)[0]["bKnee"])

    assert knee("--prefix-sharing", "0.6", "--output-tokens", "256") > 1.8 * knee()


# llama-3-8b on one H100: a 59.8 GB KV pool, so one 1,000,000-token sequence (131.1 GB) never fits;
# alone at 131,072 tokens its TPOT is 9.9 ms, at 512 tokens 4.8 ms
H100 = ["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm"]
KV_TOO_BIG = "one sequence needs 131.1 GB of KV cache, more than the 59.8 GB KV pool per GPU"


def _block(out: str, context: str) -> list[str]:
    """The lines of one context's block in the table, its header first."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"context {context} tokens:"))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def test_a_context_whose_sequence_outgrows_the_kv_pool_is_marked_and_the_others_are_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """(was: exit 2 and no table for every context when one could not run)"""
    status, out, err = run(capsys, *H100, "--context", "2048,1000000,8192", "--batch", "1,64")
    assert status == 0, err
    assert "recommended --max-num-seqs 64" in "\n".join(_block(out, "2,048"))
    assert "recommended --max-num-seqs 16" in "\n".join(_block(out, "8,192"))
    # the marked context: its size and why, and no knee, recommendation or rows to misread
    assert _block(out, "1,000,000") == [
        "context 1,000,000 tokens: KV per sequence 131,072.0 MB",
        f"  cannot run: {KV_TOO_BIG}",
    ]
    # a script that reads only the exit status still hears of it
    assert err == "batchknee plan: no batch limit runs context 1,000,000 (marked cannot run)\n"


def test_a_context_where_no_batch_meets_the_tpot_target_is_marked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        *H100,
        "--context",
        "512,131072",
        "--batch",
        "1,8",
        "--tpot-target-ms",
        "8",
        "--prompt-fraction",
        "0",
    ]
    status, out, err = run(capsys, *argv)
    assert status == 0, err
    assert "recommended --max-num-seqs" in "\n".join(_block(out, "512"))
    assert _block(out, "131,072")[1:] == [
        "  cannot run: one sequence alone has a TPOT of 9.9 ms, over the target (8 ms)"
    ]
    status, out, err = run(capsys, *argv, "--goal", "slo")
    assert status == 0, err
    assert _block(out, "131,072")[1:] == [
        "  cannot run: one sequence alone has a TPOT of 9.9 ms, over the target less --slo-margin-percent (7.2 ms)"
    ]


def test_json_gives_a_context_that_cannot_run_its_reason_and_no_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run(capsys, *H100, "--context", "2048,1000000", "--batch", "1,64", "--output", "json")
    assert status == 0, err
    fits, too_big = json.loads(out)
    assert set(fits) == set(too_big)  # one schema: tools read the same keys in every entry
    assert fits["cannotRun"] is None and fits["recommendedMaxNumSeqs"] == 64 and len(fits["rows"]) == 2
    assert too_big["cannotRun"] == KV_TOO_BIG
    assert too_big["contextLength"] == 1_000_000 and too_big["kvBytesPerSeq"] == 131072 * 1_000_000
    # null, not the minimum bound 1 or a capacity of 0 that reads as a figure to use
    for key in ("bKnee", "recommendedMaxNumSeqs", "recommendedMaxTokens", "limitedBy", "sloBatch"):
        assert too_big[key] is None, key
    assert too_big["kvCapacityBatch"] is None and too_big["explanation"] is None and too_big["rows"] == []


def test_the_plot_and_sglangs_own_pick_leave_out_a_context_that_cannot_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plotted: list[int] = []
    monkeypatch.setattr(
        "batchknee.plots.plot_plan", lambda plans, *_: plotted.extend(p.context_tokens for p in plans)
    )
    argv = [*H100, "--engine", "sglang", "--context", "2048,1000000", "--plot", str(tmp_path / "knee.png")]
    status, out, err = run(capsys, *argv)
    assert status == 0, err
    assert plotted == [2048]
    # SGLang cannot start sized for a context it cannot hold: its pick is for the longest it can
    assert out.splitlines()[-1].endswith("context length 2,048)")


def test_when_no_context_can_run_the_plan_is_refused_with_the_first_ones_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run(capsys, *H100, "--context", "1000000,2000000")
    assert status == 2 and out == ""
    assert err.strip() == (
        "batchknee plan: error: --context: one sequence of 1,000,000 tokens needs 131.1 GB of KV cache, "
        "more than the 59.8 GB KV pool per GPU; lower --context, or raise --tp"
    )


def test_trtllm_plans_with_its_own_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`--engine trtllm` changed nothing (the vLLM plan under another name): its KV pool is a share
    of what the weights leave, its step budget max_num_tokens, and its knob --max_batch_size."""
    from batchknee.core import DecodeRoofline, find_gpu, find_model
    from batchknee.engines import trtllm

    roofline = DecodeRoofline(
        find_model("llama-3-8b"), find_gpu("a100-80gb"), params=8.0e9, bandwidth_bytes_per_s=2.0e12
    )
    plans = {}
    for engine in ("vllm", "trtllm"):
        status, out, _ = run(capsys, *SEED, "--context", "2048", "--engine", engine, "--output", "json")
        assert status == 0
        [plans[engine]] = json.loads(out)
    pool = roofline.kv_pool_bytes_free_fraction(trtllm.DEFAULT_FREE_GPU_MEMORY_FRACTION)
    assert plans["trtllm"]["kvCapacityBatch"] == roofline.kv_capacity_batch(2048, pool)
    assert plans["trtllm"]["kvCapacityBatch"] != plans["vllm"]["kvCapacityBatch"]
    status, out, _ = run(capsys, *SEED, "--context", "2048", "--engine", "trtllm")
    assert "recommended --max_batch_size 64" in out and "--max-num-seqs" not in out


def test_rows_the_kv_pool_cannot_hold_are_marked(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3-8B at 8,192 tokens on an A100-80GB: the pool holds 56 sequences, so 64 and above would preempt
    status, out, _ = run(capsys, *SEED, "--context", "8192")
    assert status == 0
    rows = {
        line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["32"], ["64"], ["256"])
    }
    assert not rows["32"].endswith("> KV pool")
    assert rows["64"].endswith("> KV pool") and rows["256"].endswith("> KV pool")
    assert "(> KV pool: the KV pool holds 56 sequences; the engine preempts)" in out
    status, out, _ = run(capsys, *SEED, "--context", "512")  # every row fits: no mark, no note
    assert "KV pool" not in out.replace("(KV pool holds", "")


def test_vllms_step_budget_follows_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM batches 8,192 tokens per step on a GPU of 70 GiB or more that is not an A100 (2,048 on one)
    def p99s(*extra: str) -> list[float]:
        status, out, _ = run(
            capsys, "plan", "--model", "llama-3-8b", "--context", "2048", "--output", "json", *extra
        )
        assert status == 0
        return [row["tpotP99Ms"] for plan in json.loads(out) for row in plan["rows"]]

    h100 = ("--gpu", "h100-sxm")
    assert p99s(*h100) == p99s(*h100, "--max-num-batched-tokens", "8192")
    assert p99s(*h100) != p99s(*h100, "--max-num-batched-tokens", "2048")
    a100 = ("--gpu", "a100-80gb")
    assert p99s(*a100) == p99s(*a100, "--max-num-batched-tokens", "2048")
