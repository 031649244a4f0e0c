"""The emulator's read-bytes counter follows its own roofline: each step reads the weights and the
KV it attends, so over memory-bound decode the bytes per busy second are the bandwidth efficiency
times the GPU's peak (no overhead), and with a per-step overhead they fall by its share."""

from __future__ import annotations

import io

import pytest
from prometheus_client import generate_latest

from batchknee.emulator.engine_args import parse_emulator_args
from batchknee.emulator.server import EmulatorServer


def run(*extra: str) -> EmulatorServer:
    argv = ["--host", "127.0.0.1", "--port", "0", "--startup-delay-s", "0", "llama-3-8b", "--gpu", "a100-80gb",
            "--enable-mfu-metrics", "--bandwidth-efficiency", "0.8", "--concurrency", "64",
            "--prompt-tokens", "16", "--output-tokens", "1024", *extra]  # fmt: skip
    server = EmulatorServer(parse_emulator_args(argv, environ={}), log=io.StringIO(), out=io.StringIO())
    server.engine.run_until(60.0)
    return server


def test_bytes_per_busy_second_are_the_efficiency_times_peak() -> None:
    server = run("--overhead-ms", "0")
    stats, roofline = server.engine.stats, server.engine.roofline
    achieved = stats.read_bytes / stats.busy_time_s
    assert achieved / roofline.bandwidth == pytest.approx(0.8, rel=0.01)
    # per step: the weights once, plus the KV of about 64 sequences
    per_step = stats.read_bytes / stats.steps
    assert (
        roofline.weight_bytes_per_gpu
        < per_step
        < roofline.weight_bytes_per_gpu + roofline.kv_bytes_read(64, 16 + 1024)
    )


def test_an_overhead_lowers_the_achieved_fraction_by_its_share() -> None:
    server = run("--overhead-ms", "5")
    stats, roofline = server.engine.stats, server.engine.roofline
    achieved = stats.read_bytes / stats.busy_time_s / roofline.bandwidth
    overhead_share = 0.005 * stats.steps / stats.busy_time_s
    assert achieved == pytest.approx(0.8 * (1 - overhead_share), rel=0.01)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_under_speedup_the_counter_rate_per_wall_second_is_the_gpus_bytes_per_second(engine: str) -> None:
    """At 20× the wall clock sees 1/20 of the simulated time: the exported counter is the simulated
    bytes ÷ 20, so Prometheus's rate per wall second reads the simulated GPU's bandwidth, at most its peak."""
    server = run("--engine", engine, "--overhead-ms", "0", "--speedup", "20")
    text = generate_latest(server.registry).decode()
    exported = [
        line for line in text.splitlines() if line.startswith(f"{engine}:estimated_read_bytes_per_gpu_total")
    ]
    assert exported, text[:500]
    value = float(exported[0].rsplit(" ", 1)[1])
    assert value == pytest.approx(server.engine.stats.read_bytes / 20, rel=1e-6)
