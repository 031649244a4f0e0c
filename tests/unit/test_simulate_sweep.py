"""`batchknee simulate`: the knee measured on the simulation, its JSON contract, plot and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.emulator import EngineConfig, LoadSpec, vllm_num_gpu_blocks
from batchknee.emulator.sweep import sweep

SEED = [
    "simulate",
    "--model",
    "llama-3-8b",
    "--gpu",
    "a100-80gb",
    "--params",
    "8.0e9",
    "--bandwidth",
    "2.0TB/s",
]
ROOFLINE = DecodeRoofline(
    find_model("llama-3-8b"), find_gpu("a100-80gb"), params=8.0e9, bandwidth_bytes_per_s=2.0e12
)


def test_the_sweep_bends_at_the_knee() -> None:
    # Mean context 512 + 3072 / 2 = 2048 tokens, B_knee 59.6: doubling the batch from 32 to 64 buys
    # +48 % throughput for +35 % TPOT, from 64 to 128 only +32 % for +51 % (the seed's figures).
    config = EngineConfig(
        ROOFLINE,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        num_gpu_blocks=vllm_num_gpu_blocks(ROOFLINE, 0.9, 16),
    )
    result = sweep(config, LoadSpec(prompt_tokens=512, output_tokens=3072), [32, 64, 128])
    p32, p64, p128 = result.points
    assert result.b_knee == pytest.approx(59.6, abs=0.1)
    assert p128.throughput_tokens_per_s / p64.throughput_tokens_per_s == pytest.approx(1.32, abs=0.04)
    assert p64.throughput_tokens_per_s / p32.throughput_tokens_per_s == pytest.approx(1.48, abs=0.04)
    assert p32.tpot_p99_s < p64.tpot_p99_s < p128.tpot_p99_s
    assert p128.tpot_p99_s / p64.tpot_p99_s == pytest.approx(1.51, abs=0.04)
    assert all(
        p.preemptions == 0 and p.mean_running == pytest.approx(p.max_num_seqs, rel=0.01)
        for p in result.points
    )


def test_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        *SEED,
        "--prompt-tokens",
        "1024",
        "--output-tokens",
        "256",
        "--sweep",
        "16,64,256",
        "--duration",
        "240",
        "--tpot-target-ms",
        "20",
        "--output",
        "json",
    )
    assert status == 0
    document = json.loads(out)
    assert document["bKnee"] == pytest.approx(ROOFLINE.b_knee(1024 + 128))
    assert [p["maxNumSeqs"] for p in document["points"]] == [16, 64, 256]
    for point in document["points"]:
        assert {
            "maxNumSeqs",
            "throughputTokensPerSecond",
            "tpotP50Ms",
            "tpotP99Ms",
            "ttftP99Ms",
            "goodputTokensPerSecond",
            "preemptions",
        } <= point.keys()
    low, _, high = document["points"]
    assert high["throughputTokensPerSecond"] > low["throughputTokensPerSecond"]
    # A 20 ms target: met at B 16, missed by every request at B 256.
    assert low["goodputTokensPerSecond"] > 0.9 * low["throughputTokensPerSecond"]
    assert high["tpotP50Ms"] > 20 and high["goodputTokensPerSecond"] == 0


def test_table_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    status, out, _ = run(
        capsys, *SEED, "--prompt-tokens", "128", "--output-tokens", "128", "--sweep", "8,32", "--duration", "60",
        "--plot", str(plot),
    )  # fmt: skip
    assert status == 0
    assert "B_knee" in out and "max-num-seqs" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["8"], ["32"])]
    assert [row[0] for row in rows] == ["8", "32"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_open_loop_rate_sets_the_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, *SEED, "--request-rate", "2", "--prompt-tokens", "256", "--output-tokens", "200",
        "--sweep", "64", "--duration", "600", "--output", "json",
    )  # fmt: skip
    assert status == 0
    (point,) = json.loads(out)["points"]
    assert point["throughputTokensPerSecond"] == pytest.approx(2 * 200, rel=0.1)
    assert point["meanRunning"] < 64


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--sweep", "0"], "--sweep"),
        (["--duration", "10", "--warmup", "20"], "--warmup"),
        (["--request-rate", "1", "--concurrency", "4"], "--concurrency"),
        (["--prompt-tokens", "900000"], "--prompt-tokens"),  # (was: blamed --max-model-len, not given)
        (["--prompt-distribution", "zipf"], "--prompt-distribution"),
    ],
)
def test_errors_are_one_line_naming_the_option(
    capsys: pytest.CaptureFixture[str], extra: list[str], option: str
) -> None:
    status, out, err = run(capsys, *SEED, *extra)
    assert status == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and option in err


def test_unknown_gpu_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "simulate", "--model", "llama-3-8b", "--gpu", "tpu-v5")
    assert status == 2 and "--gpu" in err


def test_benchmark_prints_simulated_seconds_per_wall_second(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "simulate", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--prompt-tokens", "256",
        "--output-tokens", "128", "--benchmark", "--duration", "30", "--output", "json",
    )  # fmt: skip
    assert status == 0
    figures = json.loads(out)
    assert figures["requestRate"] == 100 and figures["simulatedSeconds"] == 30
    assert figures["requests"] == pytest.approx(3000, rel=0.1)
    assert figures["simulatedSecondsPerWallSecond"] > 0


def test_prefix_sharing_is_a_fraction_of_the_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    # 1024-token prompts whose first half is shared; mean context 1024 + 512 / 2 = 1280. The knee is
    # the planner's with 512 of 1280 tokens shared (read once, as the simulated engine does).
    status, out, _ = run(
        capsys, *SEED, "--prompt-tokens", "1024", "--output-tokens", "512", "--prefix-sharing", "0.5",
        "--sweep", "32", "--duration", "120", "--output", "json",
    )  # fmt: skip
    assert status == 0
    planner = DecodeRoofline(
        find_model("llama-3-8b"), find_gpu("a100-80gb"), params=8.0e9, bandwidth_bytes_per_s=2.0e12,
        prefix_sharing=512 / 1280,
    )  # fmt: skip
    assert json.loads(out)["bKnee"] == pytest.approx(planner.b_knee(1280))


def test_goal_slo_adds_the_planners_pick_and_it_meets_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "simulate", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--overhead-ms", "2",
        "--bandwidth-efficiency", "0.8", "--prompt-tokens", "1024", "--output-tokens", "2048", "--sweep", "64",
        "--tpot-target-ms", "30", "--goal", "slo", "--duration", "400", "--output", "json",
    )  # fmt: skip
    assert status == 0
    points = {p["maxNumSeqs"]: p for p in json.loads(out)["points"]}
    [pick] = set(points) - {64}
    assert pick > 64 and points[pick]["tpotP99Ms"] <= 30 * 0.9


def test_trtllm_reserves_whole_sequences_at_admission(capsys: pytest.CaptureFixture[str]) -> None:
    """`--engine trtllm` ran vLLM's scheduler: TensorRT-LLM's default (GUARANTEED_NO_EVICT) admits a
    request only with the blocks of its whole sequence free, so a limit past what the pool holds
    whole runs that many, never preempting."""
    common = ["simulate", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--sweep", "256"]
    load = ["--prompt-tokens", "1024", "--output-tokens", "1024", "--output", "json"]
    running = {}
    for engine in ("vllm", "trtllm"):
        status, out, _ = run(capsys, *common, "--engine", engine, *load)
        assert status == 0
        (point,) = json.loads(out)["points"]
        running[engine] = point["meanRunning"]
        assert point["preemptions"] == 0
    roofline = DecodeRoofline(find_model("llama-3-8b"), find_gpu("h100-sxm"))
    whole = roofline.kv_pool_bytes_free_fraction(0.9) // roofline.kv_bytes_per_seq(2048)
    assert running["vllm"] == pytest.approx(256, rel=0.01)
    assert whole * 0.95 <= running["trtllm"] <= whole
