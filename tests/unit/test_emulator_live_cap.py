"""The simulation's live cap (a runtime `max_num_seqs` under the startup ceiling) and its fault flag
(step time × k above N running sequences)."""

from __future__ import annotations

import itertools
import random

import pytest

from batchknee.core import DecodeRoofline, find_gpu, find_model
from batchknee.emulator import (
    DROPPED,
    FINISHED,
    REJECTED,
    Engine,
    EngineConfig,
    EngineConfigError,
    Request,
    vllm_num_gpu_blocks,
)
from batchknee.emulator.engine_args import EngineArgsError, parse_emulator_args

ROOFLINE = DecodeRoofline(
    find_model("llama-3-8b"), find_gpu("a100-80gb"), params=8.0e9, bandwidth_bytes_per_s=2.0e12
)


def config(**overrides: object) -> EngineConfig:
    values: dict[str, object] = {
        "roofline": ROOFLINE,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 16384,
        "num_gpu_blocks": vllm_num_gpu_blocks(ROOFLINE, 0.9, 16),
    }
    values.update(overrides)
    return EngineConfig(**values)  # type: ignore[arg-type]


class Recorder:
    """Checks the bookkeeping after every step and keeps (live cap, running) per step."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def __call__(self, engine: Engine, duration: float, tokens: int, decoding: int) -> None:
        engine.check_invariants()
        self.steps.append((engine.live_max_num_seqs, engine.num_running))


def busy_engine(requests: int = 400) -> tuple[Engine, list[Request], Recorder]:
    done: list[Request] = []
    recorder = Recorder()
    engine = Engine(config(), on_finish=done.append, step_hook=recorder)
    rng = random.Random(7)
    for _ in range(requests):
        engine.submit(rng.randint(64, 256), rng.randint(40, 400))
    return engine, done, recorder


def run_until_running(engine: Engine, at_least: int, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if engine.num_running >= at_least:
            return
        engine.run_until(engine.now, max_steps=1)
    raise AssertionError(f"the batch never reached {at_least}")


def test_lowering_the_cap_drains_to_it_without_dropping_and_never_exceeds_it_after() -> None:
    engine, done, recorder = busy_engine()
    run_until_running(engine, 64)
    received = engine.stats.received
    engine.set_live_max_num_seqs(16)
    lowered_at = len(recorder.steps)
    assert engine.draining_to_cap and engine.effective_max_num_seqs == 64
    engine.run_until(engine.now + 60.0, max_steps=20_000)

    after = [running for _, running in recorder.steps[lowered_at:]]
    reached = next(i for i, running in enumerate(after) if running <= 16)
    assert reached > 0, "the running sequences above the cap must run on, not be cut"
    # While draining nothing is admitted: the batch only shrinks; once under the cap it stays there.
    assert all(b <= a for a, b in itertools.pairwise([64, *after[: reached + 1]]))
    assert max(after[reached:]) == 16
    assert not engine.draining_to_cap and engine.effective_max_num_seqs == 16
    assert engine.stats.dropped == 0 and engine.stats.rejected == 0 and engine.stats.preemptions == 0

    assert engine.drain(max_time_s=3_600.0)
    assert engine.stats.received == received
    assert len(done) == received and all(request.state == FINISHED for request in done)
    assert not any(request.state in (DROPPED, REJECTED) for request in done)


def test_raising_the_cap_admits_up_to_it_at_the_next_step() -> None:
    engine, _, recorder = busy_engine()
    submitted = list(engine.waiting)
    engine.set_live_max_num_seqs(16)
    engine.run_until(engine.now + 20.0, max_steps=5_000)
    assert max(running for _, running in recorder.steps) == 16
    assert engine.num_waiting > 0
    engine.set_live_max_num_seqs(48)
    raised_at = len(recorder.steps)
    before, start = engine.num_running, engine.now
    engine.run_until(engine.now, max_steps=1)
    admitted = [r for r in submitted if r.first_scheduled_time == start]
    assert len(admitted) == 48 - before  # the 16384-token budget holds all their prompts: one step
    engine.run_until(engine.now + 2.0, max_steps=5_000)
    assert max(running for _, running in recorder.steps[raised_at:]) == 48
    assert engine.num_waiting > 0
    engine.set_live_max_num_seqs(64)
    raised_at = len(recorder.steps)
    engine.run_until(engine.now + 2.0, max_steps=5_000)
    assert max(running for _, running in recorder.steps[raised_at:]) == 64


def test_the_invariant_check_rejects_running_above_the_cap_unless_draining() -> None:
    engine, _, _ = busy_engine()
    run_until_running(engine, 40)
    engine.set_live_max_num_seqs(16)
    engine.check_invariants()  # draining from a lowered cap: running 40+ > 16 is fine
    engine._allowance = engine.live_max_num_seqs  # pretend the cap was never lowered
    with pytest.raises(AssertionError):
        engine.check_invariants()


@pytest.mark.parametrize("cap", [0, 65, -1, 2.5, True, "16"])
def test_a_live_cap_outside_one_to_the_ceiling_is_refused(cap: object) -> None:
    engine = Engine(config())
    with pytest.raises(EngineConfigError, match="from 1 to the startup max_num_seqs 64"):
        engine.set_live_max_num_seqs(cap)  # type: ignore[arg-type]
    assert engine.live_max_num_seqs == 64


def lockstep_throughput(batch: int, **overrides: object) -> float:
    """Generation tokens per busy second of `batch` sequences admitted together and decoding in
    lockstep, so that exactly `batch` run in every step."""
    engine = Engine(config(max_num_batched_tokens=batch * 1024, **overrides))
    for _ in range(batch):
        engine.submit(1024, 128)
    assert engine.drain()
    return engine.stats.generation_tokens / engine.stats.busy_time_s


def test_the_fault_slows_steps_only_above_its_running_count() -> None:
    slowdown, above = 3.0, 32
    clean_at, clean_above = lockstep_throughput(above), lockstep_throughput(above + 1)
    fault = {"fault_step_slowdown": slowdown, "fault_above_running": above}
    faulty_at, faulty_above = lockstep_throughput(above, **fault), lockstep_throughput(above + 1, **fault)
    assert faulty_at == pytest.approx(clean_at, rel=1e-12)  # B = N: untouched
    assert faulty_above == pytest.approx(clean_above / slowdown, rel=1e-12)
    # A cliff: one more sequence costs about the factor in throughput; without the fault it gains.
    assert clean_above > clean_at
    assert faulty_above / faulty_at == pytest.approx(1.0 / slowdown, rel=0.05)


def test_fault_settings_are_validated() -> None:
    with pytest.raises(EngineConfigError, match="fault_step_slowdown"):
        config(fault_step_slowdown=0.0)
    with pytest.raises(EngineConfigError, match="fault_above_running"):
        config(fault_above_running=-1)


def test_vllms_max_num_active_seqs_caps_the_running_batch_from_the_start() -> None:
    """vLLM 0.34's `--max-num-active-seqs`: the runner keeps --max-num-seqs, admission stops at it."""
    recorder = Recorder()
    engine = Engine(config(max_num_active_seqs=24), step_hook=recorder)
    for _ in range(200):
        engine.submit(128, 200)
    engine.run_until(30.0, max_steps=2_000)
    assert engine.live_max_num_seqs == 24 and max(running for _, running in recorder.steps) == 24
    settings = parse_emulator_args(
        ["llama-3-8b", "--max-num-seqs", "64", "--max-num-active-seqs", "24"], environ={}
    )
    assert settings.config.max_num_active_seqs == 24
    with pytest.raises(
        EngineArgsError, match=r"--max-num-active-seqs: 65 cannot be greater than --max-num-seqs 64"
    ):
        parse_emulator_args(["llama-3-8b", "--max-num-seqs", "64", "--max-num-active-seqs", "65"], environ={})
    with pytest.raises(EngineConfigError, match="max_num_active_seqs"):
        config(max_num_active_seqs=65)
