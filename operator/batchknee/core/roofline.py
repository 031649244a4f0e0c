"""The decode roofline: what one engine step reads and computes, and what that costs in time.

Per decode step every GPU reads its share of the weights once and every running sequence's KV cache:

    bytes_per_step = weight_bytes + B · kv_bytes_per_seq          (per GPU under tensor parallelism)
    step_time      = max(bytes / bandwidth, flops / peak_flops) / efficiency + overhead
    B_knee         = weight_bytes / kv_bytes_per_seq                (the two byte terms are equal)

With efficiency 1 and overhead 0 this is exactly the source document's roofline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from batchknee.core.catalog import GIB, GpuSpec, ModelArchitecture
from batchknee.core.dtypes import dtype_bytes, kv_dtype_bytes

DEFAULT_RESERVE_BYTES = 1 * GIB  # activations, CUDA graphs and non-torch memory outside the KV pool
_MAX_SEARCH_BATCH = 1 << 20
_EXACT_POISSON_MEAN = 500.0  # above it, the normal approximation of the Poisson quantile
_MAX_JOIN_TERMS = 400  # terms of a Poisson sum over a wide count: past it, every stride-th term


@dataclass(frozen=True)
class PrefillMix:
    """The prefill work chunked prefill interleaves with decoding. Every request that joins the
    batch has its prompt computed (less what the prefix cache already holds) in chunks of at most
    `max_num_batched_tokens` − B tokens that share steps with the decoding sequences: such a step
    costs far more than a decode step, and the requests whose lifetimes catch more of them set the
    TPOT tail. Token counts are means over requests."""

    prompt_tokens: float
    output_tokens: float
    max_num_batched_tokens: int = 2048
    cached_fraction: float = 0.0

    def __post_init__(self) -> None:
        if not self.prompt_tokens >= 0 or not self.output_tokens >= 1:
            raise ValueError("prompt tokens must be ≥ 0 and output tokens ≥ 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if not 0.0 <= self.cached_fraction <= 1.0:
            raise ValueError("cached_fraction must be within [0, 1]")

    @classmethod
    def for_context(
        cls, context_tokens: float, prompt_fraction: float, max_num_batched_tokens: int = 2048
    ) -> PrefillMix:
        """The mix whose mean decoding context (prompt + half the output) is `context_tokens`, of
        which `prompt_fraction` is prompt."""
        if not 0.0 <= prompt_fraction < 1.0:
            raise ValueError("prompt_fraction must be within [0, 1)")
        prompt = prompt_fraction * context_tokens
        output = max(1.0, 2.0 * (context_tokens - prompt))
        return cls(prompt, output, max_num_batched_tokens)


def poisson_quantile(mean: float, quantile: float) -> float:
    """The `quantile` of a Poisson count with this mean (the normal approximation when large)."""
    if mean <= 0:
        return 0.0
    if mean > _EXACT_POISSON_MEAN:
        return mean + NormalDist().inv_cdf(quantile) * math.sqrt(mean)
    term = math.exp(-mean)
    total, k = term, 0
    while total < quantile and k < 10 * _EXACT_POISSON_MEAN:
        k += 1
        term *= mean / k
        total += term
    return float(k)


def _poisson_terms(mean: float) -> list[tuple[int, float]]:
    """(k, weight) over k ≥ 1 that sum E[f(K)] for a Poisson count K of this mean (K = 0 adds
    nothing here): every k out to 12 σ past the mean. A large mean (a tenant's step budget of
    2^53 tokens, one-token outputs) spans millions of counts, and e^−mean underflows past about
    745: there, only the counts within 12 σ, each weighed in log space, every stride-th standing
    for its stride (the terms are smooth at that width), so the work is bounded."""
    if mean <= _EXACT_POISSON_MEAN:
        terms: list[tuple[int, float]] = []
        probability, k = math.exp(-mean), 0
        while k < 8 or k < mean + 12.0 * math.sqrt(mean) + 12.0:
            k += 1
            probability *= mean / k
            terms.append((k, probability))
        return terms
    spread = 12.0 * math.sqrt(mean) + 12.0
    first, last = max(1, math.floor(mean - spread)), math.ceil(mean + spread)
    stride = max(1, (last - first) // _MAX_JOIN_TERMS)
    log_mean = math.log(mean)
    return [
        (k, stride * math.exp(k * log_mean - mean - math.lgamma(k + 1)))
        for k in range(first, last + 1, stride)
    ]


@dataclass(frozen=True)
class DecodeRoofline:
    """One engine replica: a model on `tensor_parallel` GPUs of one type, with its dtypes.

    `params` and `bandwidth_bytes_per_s` override the catalog (the seed rounds Llama-3-8B to 8.0e9
    parameters and the A100 to 2.0 TB/s). `prefix_sharing` is the fraction of each sequence's
    context that all running sequences share (a system prompt): it is stored once, and read once
    per step when `shared_prefix_read_once` (SGLang RadixAttention / cascade kernels); engines
    whose attention re-reads shared blocks per sequence gain capacity but no bandwidth.
    """

    model: ModelArchitecture
    gpu: GpuSpec
    tensor_parallel: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "auto"
    params: float | None = None
    bandwidth_bytes_per_s: float | None = None
    bandwidth_efficiency: float = 1.0
    overhead_s: float = 0.0
    prefix_sharing: float = 0.0
    shared_prefix_read_once: bool = True

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError("tensor_parallel must be at least 1")
        if self.params is not None and not self.params > 0:
            raise ValueError("params must be positive")
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ValueError("bandwidth must be positive")
        if not 0.0 < self.bandwidth_efficiency <= 1.0:
            raise ValueError("bandwidth_efficiency must be in (0, 1]")
        if not self.overhead_s >= 0.0:
            raise ValueError("overhead must be zero or positive")
        if not 0.0 <= self.prefix_sharing < 1.0:
            raise ValueError("prefix_sharing must be in [0, 1)")
        dtype_bytes(self.weight_dtype)
        kv_dtype_bytes(self.kv_dtype, self.weight_dtype)

    # --- weights -------------------------------------------------------------------------------

    @property
    def bandwidth(self) -> float:
        """Peak HBM bandwidth of one GPU, bytes/s."""
        return self.bandwidth_bytes_per_s or self.gpu.bandwidth_bytes_per_s

    @property
    def _param_scale(self) -> float:
        # An override scales every part of the model alike (dense, experts, active).
        return (self.params or self.model.params) / self.model.params

    @property
    def model_bytes(self) -> float:
        """All weights of the model, across all GPUs."""
        return self.model.params * self._param_scale * dtype_bytes(self.weight_dtype)

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.model_bytes / self.tensor_parallel

    def expected_experts_touched(self, tokens: float) -> float:
        """Distinct routed experts per MoE layer that `tokens` tokens touch, assuming each token picks
        its k experts uniformly at random and independently of the others: E · (1 − (1 − k/E)^T).
        Real routers are skewed, which touches fewer experts; this is the upper, conservative case."""
        experts, k = self.model.experts, self.model.experts_per_token
        if experts is None or k is None:
            return 0.0
        untouched: float = (1.0 - k / experts) ** max(tokens, 0.0)
        return experts * (1.0 - untouched)

    def weight_bytes_read_per_gpu(self, tokens: float) -> float:
        """Weight bytes one GPU reads in a step that processes `tokens` tokens. Dense models read all
        weights; MoE models read the dense part plus the experts the tokens touch."""
        if not self.model.is_moe:
            return self.weight_bytes_per_gpu
        assert self.model.experts is not None
        touched_fraction = self.expected_experts_touched(tokens) / self.model.experts
        params = self.model.dense_params + self.model.routed_expert_params * touched_fraction
        return params * self._param_scale * dtype_bytes(self.weight_dtype) / self.tensor_parallel

    @property
    def active_params(self) -> float:
        return (self.model.active_params or self.model.params) * self._param_scale

    # --- KV cache ------------------------------------------------------------------------------

    @property
    def kv_heads_per_gpu(self) -> int:
        """KV heads one GPU holds: they divide by TP until TP exceeds them, then replicate."""
        return max(1, self.model.kv_heads // self.tensor_parallel)

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        """One GPU's KV bytes for one token in one layer. MLA stores one latent (replicated on every
        rank); MHA/GQA store K and V for each of the GPU's KV heads."""
        element = kv_dtype_bytes(self.kv_dtype, self.weight_dtype)
        if self.model.kv_lora_rank is not None and self.model.qk_rope_head_dim is not None:  # MLA
            return (self.model.kv_lora_rank + self.model.qk_rope_head_dim) * element
        return 2 * self.kv_heads_per_gpu * self.model.head_dim * element

    @property
    def kv_bytes_per_token(self) -> float:
        """One GPU's KV bytes per token of context, all layers, below any sliding window."""
        return self.model.layers * self.kv_bytes_per_token_per_layer

    def kv_bytes_per_seq(self, context_tokens: float) -> float:
        """One GPU's KV bytes for a sequence of `context_tokens`; windowed layers keep at most the window."""
        return self.kv_bytes_of_contexts(context_tokens, self.windowed_tokens(context_tokens))

    def windowed_tokens(self, context_tokens: float) -> float:
        """The tokens a sliding-window layer keeps of a `context_tokens` sequence: min(ctx, window)
        (the whole context when the model has no window)."""
        window = self.model.sliding_window
        return context_tokens if window is None else min(context_tokens, window)

    def kv_bytes_of_contexts(self, total_context_tokens: float, total_windowed_tokens: float) -> float:
        """One GPU's KV bytes of a set of sequences, from Σ ctx and Σ min(ctx, window) over them:
        Σ kv_bytes_per_seq(ctx) without visiting each sequence (an engine simulation keeps both sums
        incrementally). Full-attention layers hold every token, windowed layers at most the window."""
        windowed = self.model.sliding_window_layers if self.model.sliding_window is not None else 0
        full_layers = self.model.layers - windowed
        tokens = full_layers * total_context_tokens + windowed * total_windowed_tokens
        return tokens * self.kv_bytes_per_token_per_layer

    def kv_bytes_shared(self, context_tokens: float) -> float:
        """The one copy of the shared prefix."""
        return self.prefix_sharing * self.kv_bytes_per_seq(context_tokens)

    def kv_bytes_unique_per_seq(self, context_tokens: float) -> float:
        return (1.0 - self.prefix_sharing) * self.kv_bytes_per_seq(context_tokens)

    def kv_bytes_stored(self, batch: float, context_tokens: float) -> float:
        """KV bytes `batch` running sequences occupy on one GPU (the shared prefix stored once)."""
        if batch <= 0:
            return 0.0
        return batch * self.kv_bytes_unique_per_seq(context_tokens) + self.kv_bytes_shared(context_tokens)

    def kv_bytes_read(self, batch: float, context_tokens: float) -> float:
        """KV bytes one GPU reads in one decode step of `batch` sequences."""
        if batch <= 0:
            return 0.0
        if self.shared_prefix_read_once:
            return self.kv_bytes_stored(batch, context_tokens)
        return batch * self.kv_bytes_per_seq(context_tokens)

    # --- time ----------------------------------------------------------------------------------

    def attention_flops_per_pair(self) -> float:
        """FLOPs per (query token, attended token) pair across all layers, on one GPU: QKᵀ and PV,
        two FLOPs per multiply-add (the source's 4·S·D term). MLA attends in the latent space."""
        heads = self.model.attention_heads / self.tensor_parallel
        if self.model.kv_lora_rank is not None and self.model.qk_rope_head_dim is not None:  # MLA
            per_head = (
                2 * (self.model.kv_lora_rank + self.model.qk_rope_head_dim) + 2 * self.model.kv_lora_rank
            )
        else:
            per_head = 4 * self.model.head_dim
        return self.model.layers * heads * per_head

    def step_time_s(
        self,
        tokens: float,
        kv_bytes_read: float,
        attended_pairs: float,
    ) -> float:
        """Duration of one engine step on one GPU that processes `tokens` tokens (decode sequences
        plus any prefill chunk), reads `kv_bytes_read` of KV cache and attends over
        `attended_pairs` (query, key) pairs: the larger of the memory and compute roofs, divided by
        the achieved efficiency, plus the fixed per-step overhead."""
        memory_s, compute_s = self._roofs(tokens, kv_bytes_read, attended_pairs)
        return max(memory_s, compute_s) / self.bandwidth_efficiency + self.overhead_s

    def _roofs(self, tokens: float, kv_bytes_read: float, attended_pairs: float) -> tuple[float, float]:
        """A step's memory time and compute time at peak (seconds)."""
        memory_s = (self.weight_bytes_read_per_gpu(tokens) + kv_bytes_read) / self.bandwidth
        flops = 2.0 * self.active_params / self.tensor_parallel * tokens
        flops += self.attention_flops_per_pair() * attended_pairs
        return memory_s, flops / self.gpu.peak_bf16_flops

    def decode_compute_bound(self, batch: float, context_tokens: float) -> bool:
        """Whether a decode step of `batch` sequences at `context_tokens` is bound by compute, not by
        reading memory (its achieved bytes per second then say nothing of the bandwidth efficiency)."""
        memory_s, compute_s = self._roofs(
            batch, self.kv_bytes_read(batch, context_tokens), batch * context_tokens
        )
        return compute_s >= memory_s

    @staticmethod
    def prefill_attended_pairs(computed_tokens: float, chunk_tokens: float) -> float:
        """(query, key) pairs a prefill chunk attends over under causal attention: the chunk's j-th
        token (1-based) sees the `computed_tokens` already in the cache and the first j of the chunk,
        so Σ_j (computed + j) = chunk · computed + chunk · (chunk + 1) / 2. A decode step is the
        chunk of one token: computed + 1 pairs."""
        if computed_tokens < 0 or chunk_tokens < 0:
            raise ValueError("token counts must be zero or positive")
        return chunk_tokens * computed_tokens + chunk_tokens * (chunk_tokens + 1) / 2.0

    def tpot_s(self, batch: float, context_tokens: float) -> float:
        """Time per output token of a steady decode batch of `batch` sequences at `context_tokens`."""
        if batch <= 0:
            raise ValueError("batch must be positive")
        return self.step_time_s(
            batch, self.kv_bytes_read(batch, context_tokens), attended_pairs=batch * context_tokens
        )

    def chunk_step_s(self, batch: float, context_tokens: float, chunk_tokens: float) -> float:
        """A step of `batch` decoding sequences that also computes a prefill chunk of `chunk_tokens`."""
        pairs = batch * context_tokens + self.prefill_attended_pairs(0.0, chunk_tokens)
        return self.step_time_s(batch + chunk_tokens, self.kv_bytes_read(batch, context_tokens), pairs)

    def tpot_with_prefill_s(
        self, batch: float, context_tokens: float, mix: PrefillMix, quantile: float | None = None
    ) -> float:
        """Per-request TPOT (decode time / output tokens, what vLLM's TPOT histogram records) of a
        steady batch whose sequences are replaced as they finish: the mean (`quantile` None) or a
        quantile over requests.

        A = B / output requests join per decode step, a Poisson count K per step, and each brings
        its uncached prompt P. The K·P tokens are computed in chunks of at most the step budget
        C = max_num_batched_tokens − B that share steps with the decoding sequences, so a step
        costs T_D plus the chunks' extra work Y(K). A short prompt is one small chunk, not a full
        one (a 235-token prompt at B = 256 adds about 6 ms, a 1,792-token chunk about 85). A
        request decoding n steps sums n such extras: its quantile is that of a compound Poisson
        sum, taken as a Poisson count scaled to the same mean and variance. When the prompts
        outrun the budget (A·P ≥ C), every step carries a full chunk."""
        decode = self.tpot_s(batch, context_tokens)
        prompt = mix.prompt_tokens * (1.0 - mix.cached_fraction)
        if prompt <= 0:
            return decode
        budget = max(1.0, mix.max_num_batched_tokens - batch)
        full_chunk = self.chunk_step_s(batch, context_tokens, budget)
        joins = batch / mix.output_tokens
        if joins * prompt >= budget:
            return full_chunk
        kv_read = self.kv_bytes_read(batch, context_tokens)
        cached = mix.prompt_tokens - prompt
        pairs_per_token = self.prefill_attended_pairs(cached, prompt) / prompt

        def chunk_extra(tokens: float) -> float:
            pairs = batch * context_tokens + tokens * pairs_per_token
            return self.step_time_s(batch + tokens, kv_read, pairs) - decode

        def extra(prompts: int) -> float:
            full, rest = divmod(prompts * prompt, budget)
            return full * chunk_extra(budget) + (chunk_extra(rest) if rest > 0 else 0.0)

        mean = second = 0.0
        for k, probability in _poisson_terms(joins):
            y = extra(k)
            mean += probability * y
            second += probability * y * y
        if quantile is None or mean <= 0:
            return decode + mean
        steps = max(1.0, mix.output_tokens - 1.0)
        size = second / mean  # one "event" of the scaled Poisson count
        total = size * poisson_quantile(steps * mean / size, quantile)
        return min(full_chunk, decode + total / steps)

    def max_batch_for_tpot_quantile(
        self, tpot_target_s: float, context_tokens: float, mix: PrefillMix, quantile: float = 0.99
    ) -> int:
        """The largest batch whose TPOT `quantile` under the prefill `mix` meets the target (0 when
        even one sequence misses it); only batches below the step token budget are considered."""
        if tpot_target_s <= 0:
            raise ValueError("tpot target must be positive")

        def meets(batch: int) -> bool:
            return self.tpot_with_prefill_s(batch, context_tokens, mix, quantile) <= tpot_target_s

        if not meets(1):
            return 0
        low, high = 1, min(max(2, mix.max_num_batched_tokens), _MAX_SEARCH_BATCH)
        if meets(high):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if meets(middle) else (low, middle)
        return low

    def throughput_tokens_per_s(self, batch: float, context_tokens: float) -> float:
        """Aggregate output tokens per second of that batch: B / TPOT(B)."""
        return batch / self.tpot_s(batch, context_tokens)

    def b_knee(self, context_tokens: float) -> float:
        """The batch at which KV bytes read per step equal the weight bytes read: past it, each
        added sequence costs more time than it adds throughput share. Independent of bandwidth."""
        if context_tokens <= 0:
            raise ValueError("context_tokens must be positive")
        unique = self.kv_bytes_unique_per_seq(context_tokens) if self.shared_prefix_read_once else None
        if not self.model.is_moe:
            if unique is None:
                return self.weight_bytes_per_gpu / self.kv_bytes_per_seq(context_tokens)
            return max(0.0, (self.weight_bytes_per_gpu - self.kv_bytes_shared(context_tokens)) / unique)

        # MoE: the weights read grow with B, so solve kv_read(B) = weights_read(B). The difference
        # is convex (linear minus concave) and negative near zero, so it has one positive root.
        def gap(batch: float) -> float:
            return self.kv_bytes_read(batch, context_tokens) - self.weight_bytes_read_per_gpu(batch)

        low, high = 0.0, 1.0
        for _ in range(80):  # 2^80 sequences: far past any real knee, however short the context
            if gap(high) >= 0.0:
                break
            low, high = high, high * 2.0
        for _ in range(100):
            middle = (low + high) / 2.0
            low, high = (middle, high) if gap(middle) < 0.0 else (low, middle)
        return (low + high) / 2.0

    def max_batch_for_tpot(self, tpot_target_s: float, context_tokens: float) -> int:
        """The largest batch whose TPOT meets the target (0 when even one sequence misses it).
        TPOT is non-decreasing in B, so a binary search finds it."""
        if tpot_target_s <= 0:
            raise ValueError("tpot target must be positive")
        if self.tpot_s(1, context_tokens) > tpot_target_s:
            return 0
        low, high = 1, 2
        while high < _MAX_SEARCH_BATCH and self.tpot_s(high, context_tokens) <= tpot_target_s:
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            if self.tpot_s(middle, context_tokens) <= tpot_target_s:
                low = middle
            else:
                high = middle
        return low

    # --- memory capacity -----------------------------------------------------------------------

    def kv_pool_bytes(
        self, gpu_memory_utilization: float = 0.9, reserve_bytes: float = DEFAULT_RESERVE_BYTES
    ) -> float:
        """vLLM's KV pool on one GPU: memory × utilization − weights − reserve (may be negative: the
        model does not fit)."""
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        return self.gpu.memory_bytes * gpu_memory_utilization - self.weight_bytes_per_gpu - reserve_bytes

    def kv_pool_bytes_free_fraction(
        self, free_gpu_memory_fraction: float = 0.9, reserve_bytes: float = DEFAULT_RESERVE_BYTES
    ) -> float:
        """TensorRT-LLM's KV pool: a fraction of the memory left after weights and reserve."""
        if not 0.0 < free_gpu_memory_fraction <= 1.0:
            raise ValueError("free_gpu_memory_fraction must be in (0, 1]")
        return (self.gpu.memory_bytes - self.weight_bytes_per_gpu - reserve_bytes) * free_gpu_memory_fraction

    def kv_capacity_batch(self, context_tokens: float, pool_bytes: float) -> int:
        """How many sequences of `context_tokens` a KV pool of `pool_bytes` holds at once."""
        room = pool_bytes - self.kv_bytes_shared(context_tokens)
        if room <= 0:
            return 0
        return math.floor(room / self.kv_bytes_unique_per_seq(context_tokens))

    def knee_max_tokens(self) -> float:
        """TensorRT-LLM's KV token cap at the knee, B_knee · ctx = weights / kv bytes per token:
        independent of the context length (below any sliding window, without prefix sharing)."""
        return self.weight_bytes_per_gpu / self.kv_bytes_per_token
