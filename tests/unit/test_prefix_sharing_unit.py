"""One meaning of prefix sharing: a share of each prompt, in the emulator's load and in `plan`.

The operator reads the context per running sequence from the KV pool (a shared prefix counted once)
and recommends the knee of that; `plan --prefix-sharing` must land on the same batch limit when it
is given the share of the prompt the engines' prefix-cache hit rate shows.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from cli_runner import run

from batchknee.core import DecodeRoofline, find_gpu, find_model, recommend
from batchknee.emulator import Engine, EngineConfig, LoadSpec, vllm_num_gpu_blocks

ROOFLINE = DecodeRoofline(find_model("llama-3-8b"), find_gpu("a100-80gb"))


def operator_choice(prompt: int, output: int, share_of_prompt: float, batch: int) -> tuple[int, float]:
    """What the operator recommends from an engine running at `batch`: the knee of the context per
    running sequence read from the KV pool's usage (what the Prometheus adapter computes)."""
    config = EngineConfig(
        roofline=ROOFLINE,
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, batch),
        num_gpu_blocks=vllm_num_gpu_blocks(ROOFLINE, 0.9, 16),
        enable_prefix_caching=True,
    )
    load = LoadSpec(
        prompt_tokens=prompt, output_tokens=output, prefix_sharing=share_of_prompt, concurrency=2 * batch
    )
    engine = Engine(config, load=load, seed=3)
    engine.run_until(120)
    held = running = 0.0
    for second in range(1, 301):
        engine.run_until(120 + second)
        held += engine.kv_cache_usage * engine.total_blocks * engine.block_size
        running += engine.num_running
    context = held / running
    return recommend(ROOFLINE, context, kv_pool_bytes=ROOFLINE.kv_pool_bytes(0.9)).max_num_seqs, context


@pytest.mark.parametrize(("prompt", "output"), [(1536, 512), (3584, 1024)])
def test_plan_agrees_with_what_the_operator_chooses(
    capsys: pytest.CaptureFixture[str], prompt: int, output: int
) -> None:
    context = prompt + output // 2  # what the running sequences hold on average (fixed lengths)
    status, out, _ = run(
        capsys, "plan", "--model", "llama-3-8b", "--gpu", "a100-80gb", "--context", str(context),
        "--output-tokens", str(output), "--prefix-sharing", "0.6", "--output", "json",
    )  # fmt: skip
    assert status == 0
    planned = json.loads(out)[0]["recommendedMaxNumSeqs"]
    chosen, seen = operator_choice(prompt, output, 0.6, planned)
    print(f"prompt {prompt}, output {output}: plan {planned}, operator {chosen} (sees ctx {seen:.0f})")
    assert chosen == planned
    # reading 60 % as a share of the context (the old unit) plans more than the operator runs
    as_context = recommend(replace(ROOFLINE, prefix_sharing=0.6), context).max_num_seqs
    assert as_context > chosen
