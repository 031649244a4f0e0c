"""TensorRT-LLM in the emulator: the context the operator reads, and the batch the rendered options admit.

Under TensorRT-LLM's default GUARANTEED_NO_EVICT scheduler each request reserves its prompt and its
whole output from admission, so the KV pool shows the reservation (about 1.56× the decode-time
average on the demo's traffic). The engines here run from the objects the operator renders (the
trtllm-serve args and the options file, parsed by the emulator as a pod would be), and are read the
way the Prometheus adapter reads them: gauges averaged over the window, counters as rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batchknee.api.resolve import parse_llmserving, resolve_roofline
from batchknee.core import recommend
from batchknee.core.engine_args import ENGINE_CONFIG_PATH
from batchknee.core.observation import Reading, decode_context_under_reservation
from batchknee.demo.scenario import FULL, Phase
from batchknee.emulator import Engine, LoadSpec
from batchknee.emulator.engine_args import parse_emulator_args
from batchknee.render import Desired, render


def llmserving(*args: str) -> Any:
    return parse_llmserving(
        {
            "metadata": {"name": "trt", "namespace": "ml", "uid": "u-1"},
            "spec": {
                "engine": "TensorRTLLM",
                "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
                "gpu": {"type": "a100-80gb", "count": 1},
                "args": list(args),
            },
        }
    )


def engine_from_render(tmp_path: Path, batch: int, phase: Phase, *args: str) -> Engine:
    """An emulated trtllm-serve pod started from the operator's Deployment and options ConfigMap."""
    config_map, _, _, deployment = render(llmserving(*args), Desired(batch, batch * phase.target_context))
    options = tmp_path / "engine.yaml"
    options.write_text(config_map["data"]["engine.yaml"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    argv = [
        a if a != ENGINE_CONFIG_PATH else str(options)
        for a in [*container["command"][1:], *container["args"]]
    ]
    settings = parse_emulator_args(["--engine", "trtllm", "--gpu", "a100-80gb", "serve", *argv], environ={})
    assert settings.config.reserve_full_sequence  # TensorRT-LLM's default scheduler
    return Engine(settings.config, load=LoadSpec().merged(phase.load()), seed=7)


@dataclass(frozen=True)
class Window:
    reserved_per_running: float  # what the KV pool shows per running request
    mean_prompt: float  # prompt-token counter / finished-request counter
    running: float


def scrape(engine: Engine, warmup_s: float, window_s: float, every_s: float = 1.0) -> Window:
    engine.run_until(warmup_s)
    prompts, finished = engine.stats.prompt_tokens, engine.stats.finished
    usage = running = 0.0
    samples = round(window_s / every_s)
    for i in range(1, samples + 1):
        engine.run_until(warmup_s + i * every_s)
        usage += engine.kv_cache_usage * engine.total_blocks * engine.block_size
        running += engine.num_running
    return Window(
        reserved_per_running=usage / running,
        mean_prompt=(engine.stats.prompt_tokens - prompts) / (engine.stats.finished - finished),
        running=running / samples,
    )


def knee(context: float) -> int:
    roofline = resolve_roofline(llmserving().spec)
    return recommend(roofline, context, kv_pool_bytes=roofline.kv_pool_bytes_free_fraction(0.9)).max_num_seqs


@pytest.mark.parametrize(
    ("phase", "expected"), [(FULL.phases[0], 240), (FULL.phases[1], 64)], ids=["512", "2048"]
)
def test_the_context_read_from_token_counts_lands_at_the_decode_time_knee(
    tmp_path: Path, phase: Phase, expected: int
) -> None:
    engine = engine_from_render(tmp_path, expected, phase)
    seen = scrape(engine, warmup_s=200, window_s=600)
    context = decode_context_under_reservation(
        Reading.of(seen.reserved_per_running), Reading.of(seen.mean_prompt)
    )
    assert context.value is not None
    print(
        f"ctx {phase.target_context}: reservation {seen.reserved_per_running:.0f} "
        f"({seen.reserved_per_running / phase.target_context:.2f}×) → knee {knee(seen.reserved_per_running)}; "
        f"from token counts {context.value:.0f} → knee {knee(context.value)}"
    )
    assert knee(phase.target_context) == expected  # the demo's decode-time average: 240 / 64
    assert knee(context.value) == expected
    assert context.value == pytest.approx(phase.target_context, rel=0.03)
    assert knee(seen.reserved_per_running) < 0.75 * expected  # what reading the pool alone gave


def test_the_batch_is_not_starved_at_16_and_context_8192(tmp_path: Path) -> None:
    phase = FULL.phases[2]  # avg context 8,192 tokens, 6,144-token answers, 48 in flight per pod
    seen = scrape(
        engine_from_render(tmp_path, 16, phase, "--max_seq_len", "16384"), warmup_s=600, window_s=1200
    )
    print(f"B 16, ctx 8192: running {seen.running:.1f}")
    assert seen.running >= 15.5  # was 10.7 with kv_cache_config.max_tokens = 16 × 8,192

    # the same engine with the old token cap B × average context, for contrast
    capped = tmp_path / "capped"
    capped.mkdir()
    llms = llmserving("--max_seq_len", "16384")
    old = llms.spec.model_copy(
        update={"extra_llm_api_options": {"kv_cache_config": {"max_tokens": 16 * phase.target_context}}}
    )
    config_map, _, _, deployment = render(llms.model_copy(update={"spec": old}), Desired(16, 0))
    (capped / "engine.yaml").write_text(config_map["data"]["engine.yaml"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    argv = [
        a if a != ENGINE_CONFIG_PATH else str(capped / "engine.yaml")
        for a in [*container["command"][1:], *container["args"]]
    ]
    settings = parse_emulator_args(["--engine", "trtllm", "--gpu", "a100-80gb", "serve", *argv], environ={})
    starved = scrape(Engine(settings.config, load=LoadSpec().merged(phase.load()), seed=7), 600, 1200)
    print(f"with max_tokens 16 × 8192: running {starved.running:.1f}")
    assert starved.running < 13
