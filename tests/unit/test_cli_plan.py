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
    assert "TensorRT-LLM max_tokens 131,072" in out
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
