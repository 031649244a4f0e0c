"""A discrete-event model of a continuous-batching engine (vLLM V1's scheduler, TensorRT-LLM's
guaranteed-no-evict mode), fast enough for an hour of traffic in seconds.

Each engine step:
1. every decoding sequence gets one token (its KV grows by one slot; a new block when the slot
   starts one). When the KV pool cannot give those blocks, the newest running requests are
   preempted (recompute: their blocks are freed and they go back to the front of the queue);
2. partially prefilled requests continue their prompt in chunks, in admission order;
3. waiting requests are admitted first-come first-served while fewer than the live cap run
   (`live_max_num_seqs`, at most the startup `max_num_seqs`), the token budget
   (`max_num_batched_tokens`) lasts and the pool has the blocks for their first chunk (with prefix
   caching, shared-prefix blocks already cached are hits, not allocations).
The live cap can change between steps (`set_live_max_num_seqs`). Lowering it below the running
batch drops nothing: the sequences already running run to completion, and none is admitted until
the batch is under the new cap.
Shared prefix blocks are read once per step when the roofline says so (`shared_prefix_read_once`,
vLLM's cascade attention), else once per sequence.
The step lasts `DecodeRoofline.step_time_s(tokens, kv bytes read, attended pairs)` (times optional
lognormal noise, and times `fault_step_slowdown` while more than `fault_above_running` sequences
run: a stand-in for a kernel or memory cliff); tokens appear at its end.

Cost per step is O(1) plus O(prefilling + admitted + finishing requests): decoding sequences are
not visited. They all advance one token per step, so each is described by the step it joined the
decode group and the sums the step needs (Σ context, Σ min(context, window)) are kept
incrementally; which sequences need a new KV block in step s is a count per residue
(context − s) mod block_size; finishing steps are known when a sequence starts decoding.

Pure: simulated time is a float that only this module advances; no clock, no I/O.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from heapq import heappop, heappush

from batchknee.core.roofline import DEFAULT_RESERVE_BYTES, DecodeRoofline
from batchknee.emulator.stats import EngineStats
from batchknee.emulator.workload import LoadGenerator, LoadSpec, Schedule

WAITING, PREFILL, DECODE, FINISHED, REJECTED, DROPPED = range(6)
STATE_NAMES = ("waiting", "prefill", "decode", "finished", "rejected", "dropped")
REFUSED_RETRY_S = 0.1  # a closed-loop client's pause after its request was refused


class EngineConfigError(ValueError):
    """An engine configuration the real engine would refuse to start with."""


@dataclass(frozen=True)
class EngineConfig:
    """One engine replica. `num_gpu_blocks` is the KV pool in blocks of `block_size` tokens.

    `reserve_full_sequence` is TensorRT-LLM's default capacity policy (GUARANTEED_NO_EVICT): a
    request is admitted only when the blocks for its whole prompt + output are free, and holds them
    from the start, so nothing is ever preempted. vLLM allocates as sequences grow and preempts.
    """

    roofline: DecodeRoofline
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    enable_prefix_caching: bool = False
    reserve_full_sequence: bool = False
    step_noise: float = 0.0
    max_waiting: int = 100_000
    fault_step_slowdown: float = 1.0
    fault_above_running: int | None = None
    max_num_active_seqs: int | None = None  # vLLM 0.34: admission into the running batch, ≤ max_num_seqs

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise EngineConfigError("max_num_seqs must be at least 1")
        if self.max_num_active_seqs is not None and not 1 <= self.max_num_active_seqs <= self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_active_seqs ({self.max_num_active_seqs}) cannot be greater than max_num_seqs "
                f"({self.max_num_seqs})"
            )
        if not math.isfinite(self.fault_step_slowdown) or self.fault_step_slowdown <= 0.0:
            raise EngineConfigError("fault_step_slowdown must be a positive factor")
        if self.fault_above_running is not None and self.fault_above_running < 0:
            raise EngineConfigError("fault_above_running must be zero or positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or "
                f"equal to max_num_seqs ({self.max_num_seqs})"
            )
        if self.block_size < 1:
            raise EngineConfigError("block_size must be at least 1")
        if self.max_model_len < 2:
            raise EngineConfigError("max_model_len must be at least 2")
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise EngineConfigError(
                f"the KV pool holds {max(self.num_gpu_blocks, 0) * self.block_size} tokens "
                f"({max(self.num_gpu_blocks, 0)} blocks of {self.block_size}), fewer than one sequence "
                f"of max_model_len {self.max_model_len}: lower max_model_len or raise the memory "
                "given to the KV cache"
            )
        if not 0.0 <= self.step_noise <= 1.0:
            raise EngineConfigError("step_noise must be within [0, 1]")
        if self.max_waiting < 1:
            raise EngineConfigError("max_waiting must be at least 1")

    @property
    def kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def blocks_for_pool(roofline: DecodeRoofline, pool_bytes: float, block_size: int) -> int:
    """Whole blocks of `block_size` tokens a KV pool of `pool_bytes` (one GPU) holds."""
    if pool_bytes <= 0:
        return 0
    return math.floor(pool_bytes / (block_size * roofline.kv_bytes_per_token))


def no_kv_memory(roofline: DecodeRoofline, utilization: float) -> str:
    """Why a setup has no KV cache, with the figures."""
    return (
        f"{roofline.model.name} ({roofline.weight_bytes_per_gpu / 1e9:.1f} GB of weights per GPU) leaves no KV "
        f"cache memory on {roofline.gpu.name} ({roofline.gpu.memory_bytes / 1e9:.1f} GB at {utilization:g})"
    )


def vllm_num_gpu_blocks(
    roofline: DecodeRoofline,
    gpu_memory_utilization: float,
    block_size: int,
    reserve_bytes: float = DEFAULT_RESERVE_BYTES,
) -> int:
    """vLLM's pool: memory × utilization − weights − activations/graphs, in blocks."""
    return blocks_for_pool(
        roofline, roofline.kv_pool_bytes(gpu_memory_utilization, reserve_bytes), block_size
    )


def trtllm_num_blocks(
    roofline: DecodeRoofline,
    free_gpu_memory_fraction: float,
    max_tokens: int | None,
    tokens_per_block: int,
    reserve_bytes: float = DEFAULT_RESERVE_BYTES,
) -> int:
    """TensorRT-LLM's pool: a fraction of the memory left after weights; with `max_tokens` too, the
    smaller budget wins."""
    pool = roofline.kv_pool_bytes_free_fraction(free_gpu_memory_fraction, reserve_bytes)
    if max_tokens is not None:
        pool = min(pool, max_tokens * roofline.kv_bytes_per_token)
    return blocks_for_pool(roofline, pool, tokens_per_block)


class Request:
    """One request and, once it is done, its record (TTFT, TPOT, e2e latency, preemptions).

    While a request decodes, `generated`, `computed` and `private_blocks` are frozen at the values
    it joined the decode group with (`join_step`); the engine derives the live values from the
    step counter when it leaves."""

    __slots__ = (
        "arrival",
        "closed_loop",
        "computed",
        "cross_step",
        "finish_reason",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "generated",
        "holds_prefix",
        "id",
        "join_step",
        "last_token_time",
        "output",
        "phase",
        "preemptions",
        "private_blocks",
        "prompt",
        "segment_start",
        "segments",
        "shared_blocks",
        "state",
        "tag",
    )

    def __init__(
        self,
        request_id: int,
        arrival: float,
        prompt: int,
        output: int,
        shared_blocks: int,
        finish_reason: str,
        closed_loop: bool,
        tag: object,
    ) -> None:
        self.id = request_id
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.shared_blocks = shared_blocks
        self.finish_reason = finish_reason
        self.closed_loop = closed_loop
        self.tag = tag
        self.state = WAITING
        self.generated = 0
        self.computed = 0
        self.private_blocks = 0
        self.holds_prefix = False
        self.join_step = -1
        self.phase = -1
        self.cross_step = -1
        self.preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.segment_start = -1
        self.segments: list[tuple[int, int]] | None = None

    @property
    def state_name(self) -> str:
        return STATE_NAMES[self.state]

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival

    @property
    def tpot_s(self) -> float | None:
        """vLLM's per-request TPOT: decode time / (output tokens − 1); None for one output token."""
        if self.finish_time is None or self.first_token_time is None or self.output < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.output - 1)

    @property
    def queue_time_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id}, {self.state_name}, prompt={self.prompt}, output={self.output}, "
            f"generated={self.generated}, preemptions={self.preemptions})"
        )


StepHook = Callable[["Engine", float, int, int], None]


class Engine:
    """The simulation. Feed it arrivals (a built-in `load`, or `submit`), then `run_until(t)`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        load: LoadSpec | Schedule | None = None,
        seed: int = 0,
        on_finish: Callable[[Request], None] | None = None,
        keep_token_times: bool = False,
        step_hook: StepHook | None = None,
        closed_loop_ramp_s: float = 0.0,
    ) -> None:
        self.config = config
        self.roofline = config.roofline
        self.block_size = config.block_size
        self.stats = EngineStats(max_model_len=config.max_model_len)
        self.on_finish = on_finish
        self.step_hook = step_hook
        self.now = 0.0
        self.step_index = 0
        self.last_step_s = 0.0
        self._noise_rng = random.Random(f"{seed}/steps")
        self._noise_sigma = config.step_noise
        self._next_id = 0
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # insertion order = priority: the newest is preempted first
        self.prefilling: dict[int, Request] = {}
        self._external: list[tuple[float, int, Request]] = []
        # decode group
        self.num_decoding = 0
        self._dec_computed = 0  # Σ computed tokens of decoding sequences, before the next step
        self._phase_counts = [0] * self.block_size
        self._finish_at: dict[int, list[Request]] = {}
        window = self.roofline.model.sliding_window if self.roofline.model.sliding_window_layers else None
        self._window = window
        self._dec_windowed = 0  # Σ min(computed, window)
        self._dec_below_window = 0
        self._cross_at: dict[int, int] = {}
        # KV pool: private blocks of running requests, and the shared prefix's blocks [0, m) of which
        # [0, z) are referenced by running requests and [z, m) are cached but free (evictable).
        self.total_blocks = config.num_gpu_blocks
        self.used_private_blocks = 0
        self.prefix_cached_blocks = 0  # m
        self.prefix_in_use_blocks = 0  # z
        self._prefix_refs = [0] * (config.max_model_len // config.block_size + 2)
        self._prefix_holder_blocks = 0  # Σ shared blocks over the running requests that hold them
        self._read_shared_once = config.enable_prefix_caching and self.roofline.shared_prefix_read_once
        self.step_end_times: list[float] | None = [] if keep_token_times else None
        self._reserve = config.reserve_full_sequence
        self.load: LoadGenerator | None = None
        if load is not None:
            self.load = LoadGenerator(
                load, random.Random(f"{seed}/load"), closed_loop_ramp_s=closed_loop_ramp_s
            )
        self._load_rng_seed = seed
        self._live_cap = config.max_num_active_seqs or config.max_num_seqs
        # While draining down to a lowered cap: the most sequences that may run (the batch when the
        # cap was lowered, shrinking as sequences leave); never below the live cap.
        self._allowance = config.max_num_seqs

    # --- the live cap --------------------------------------------------------------------------

    @property
    def live_max_num_seqs(self) -> int:
        """The runtime cap on running sequences (at most the startup `max_num_seqs`, the ceiling)."""
        return self._live_cap

    @property
    def effective_max_num_seqs(self) -> int:
        """The running count the scheduler tolerates now: the live cap, or the batch still running
        above a lowered cap while it drains."""
        return max(self._live_cap, min(self._allowance, len(self.running)))

    @property
    def draining_to_cap(self) -> bool:
        return len(self.running) > self._live_cap

    def set_live_max_num_seqs(self, cap: int) -> None:
        """Set the runtime cap, enforced from the next step on. Nothing is dropped or preempted:
        above a lowered cap the running sequences run to completion and no new one is admitted
        until the batch is under the cap. EngineConfigError when `cap` is outside 1 … max_num_seqs."""
        ceiling = self.config.max_num_seqs
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= ceiling:
            raise EngineConfigError(
                f"the live max_num_seqs must be a whole number from 1 to the startup max_num_seqs "
                f"{ceiling}, not {cap!r}"
            )
        self._live_cap = cap
        self._allowance = max(cap, len(self.running))

    # --- observation ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def free_blocks(self) -> int:
        """Blocks not held by a running request (cached-but-unreferenced prefix blocks count as
        free: the allocator may evict them), as vLLM counts its free block queue."""
        return self.total_blocks - self.used_private_blocks - self.prefix_in_use_blocks

    @property
    def used_blocks(self) -> int:
        return self.used_private_blocks + self.prefix_in_use_blocks

    @property
    def kv_cache_usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: 1 − free / total, a fraction."""
        return self.used_blocks / self.total_blocks

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting) + len(self._external)

    def tokens_generated(self, request: Request) -> int:
        """Output tokens `request` has so far (a decoding request's count is derived from the step
        counter: it gains one per step since it joined the decode group)."""
        if request.state == DECODE:
            return request.generated + (self.step_index - 1 - request.join_step)
        return request.generated

    def token_times(self, request: Request) -> list[float]:
        """When each output token of `request` appeared (needs `keep_token_times`)."""
        if self.step_end_times is None or request.segments is None:
            raise ValueError("token times are kept only with keep_token_times=True")
        times = self.step_end_times
        return [times[i] for start, end in request.segments for i in range(start, end + 1)]

    # --- arrivals ------------------------------------------------------------------------------

    def set_load(self, load: LoadSpec, at: float) -> None:
        """Change the built-in load from simulated time `at` on."""
        if self.load is None:
            self.load = LoadGenerator(load, random.Random(f"{self._load_rng_seed}/load"), start_s=at)
        else:
            self.load.set_load(load, at)

    def stop_load(self) -> None:
        if self.load is not None:
            self.load.stop()

    def submit(
        self,
        prompt_tokens: int,
        output_tokens: int,
        *,
        at: float | None = None,
        shared_prefix_tokens: int = 0,
        finish_reason: str = "length",
        tag: object = None,
    ) -> Request:
        """A request arriving at simulated time `at` (default: now). Returns it; its state says
        whether it was turned away (REJECTED: too long for max_model_len, or the queue is full)."""
        time = self.now if at is None else at
        request = self._create(
            time, prompt_tokens, output_tokens, shared_prefix_tokens, finish_reason, False, tag
        )
        if request.state != REJECTED:
            if time <= self.now:
                self._enqueue(request)
            else:
                heappush(self._external, (time, request.id, request))
        return request

    def _create(
        self,
        time: float,
        prompt: int,
        output: int,
        shared_prefix: int,
        finish_reason: str,
        closed_loop: bool,
        tag: object,
    ) -> Request:
        config = self.config
        self.stats.received += 1
        self._next_id += 1
        prompt = max(1, int(prompt))
        output = max(1, min(int(output), config.max_model_len - prompt))
        shared_blocks = 0
        if config.enable_prefix_caching and shared_prefix > 0:
            # A cache hit never covers the last prompt token (it must be computed to sample).
            shared_blocks = min(int(shared_prefix), prompt - 1) // config.block_size
        request = Request(self._next_id, time, prompt, output, shared_blocks, finish_reason, closed_loop, tag)
        if self.step_end_times is not None:
            request.segments = []
        if prompt >= config.max_model_len:
            self._reject(request, time)
        return request

    def _reject(self, request: Request, time: float) -> None:
        request.state = REJECTED
        request.finish_time = time
        self.stats.rejected += 1
        if request.closed_loop and self.load is not None:
            # a client turned away sends its next request a little later, as after an HTTP error
            # (at the same instant, a prompt past max_model_len or a full queue was refused for ever
            # without simulated time moving: the run never ended)
            self.load.request_done(time + REFUSED_RETRY_S)
        if self.on_finish is not None:
            self.on_finish(request)

    def _enqueue(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            self._reject(request, max(request.arrival, self.now))
            return
        self.waiting.append(request)

    def _admit_arrivals(self) -> None:
        now = self.now
        load = self.load
        if load is not None:
            while load.next_time <= now:
                arrival = load.pop()
                request = self._create(
                    arrival.time,
                    arrival.prompt_tokens,
                    arrival.output_tokens,
                    arrival.shared_prefix_tokens,
                    "stop",
                    arrival.closed_loop,
                    None,
                )
                if request.state != REJECTED:
                    self._enqueue(request)
        external = self._external
        while external and external[0][0] <= now:
            self._enqueue(heappop(external)[2])

    def next_arrival_time(self) -> float:
        load_next = self.load.next_time if self.load is not None else math.inf
        external_next = self._external[0][0] if self._external else math.inf
        return min(load_next, external_next)

    # --- running -------------------------------------------------------------------------------

    def run_until(self, t_limit: float, max_steps: int | None = None) -> int:
        """Run every step that starts at or before `t_limit` (the last may end after it); when
        idle, the clock moves to `t_limit`. Returns the number of steps run."""
        steps = 0
        while True:
            self._admit_arrivals()
            if not self.running and not self.waiting:
                upcoming = self.next_arrival_time()
                if upcoming > t_limit or upcoming == math.inf:
                    if t_limit != math.inf and self.now < t_limit:
                        self.now = t_limit
                    return steps
                self.now = max(self.now, upcoming)
                continue
            if self.now > t_limit or (max_steps is not None and steps >= max_steps):
                return steps
            if self._step():
                steps += 1

    def drain(self, max_time_s: float = math.inf, max_steps: int | None = None) -> bool:
        """Stop the built-in load and run until every request is done (or `max_time_s` of
        simulated time passes). True when nothing is left."""
        self.stop_load()
        deadline = self.now + max_time_s
        self.run_until(deadline, max_steps)
        return self.in_flight == 0

    def drop_all(self) -> int:
        """Give up every request still queued or running (the process is going away)."""
        dropped = 0
        for request in [*self.running.values(), *self.waiting, *(entry[2] for entry in self._external)]:
            if request.state == DECODE:
                self._leave_decode(request, self.step_index)
            self._release(request)
            request.state = DROPPED
            request.finish_time = self.now
            dropped += 1
            if self.on_finish is not None:
                self.on_finish(request)
        self.running.clear()
        self.prefilling.clear()
        self.waiting.clear()
        self._external.clear()
        self.stats.dropped += dropped
        return dropped

    # --- the step ------------------------------------------------------------------------------

    def _step(self) -> bool:
        """One engine step; False when nothing could be scheduled (a request was preempted or
        turned away to make progress) and no time passed."""
        s = self.step_index
        config = self.config
        bs = self.block_size
        stats = self.stats
        window = self._window
        budget = config.max_num_batched_tokens
        tokens = 0
        context = 0  # Σ KV tokens each scheduled sequence holds after this step's writes
        windowed = 0  # Σ min(that, window)
        pairs = 0.0

        n = self.num_decoding
        if n:
            if window is not None:
                self._dec_below_window -= self._cross_at.pop(s, 0)
            if not self._reserve:
                need = self._phase_counts[-s % bs]
                if need > self.free_blocks:
                    need = self._preempt_for_decode(need, s)
                    n = self.num_decoding
                if need:
                    self._allocate(need)
            if n:
                tokens = n
                budget -= n
                context = self._dec_computed + n
                pairs = float(context)
                if window is not None:
                    windowed = self._dec_windowed + self._dec_below_window

        scheduled: list[tuple[Request, int]] = []
        if self.prefilling and budget > 0:
            for request in list(self.prefilling.values()):
                chunk = self._chunk_for(request, budget)
                if chunk <= 0:
                    continue
                scheduled.append((request, chunk))
                budget -= chunk
                if budget <= 0:
                    break

        waiting = self.waiting
        running = self.running
        self._allowance = max(self._live_cap, min(self._allowance, len(running)))
        while waiting and budget > 0 and len(running) < self._live_cap:
            request = waiting[0]
            chunk = self._admit(request, budget)
            if chunk <= 0:
                break
            waiting.popleft()
            scheduled.append((request, chunk))
            budget -= chunk

        for request, chunk in scheduled:  # the prefill chunks' share of this step's work
            start = request.computed
            tokens += chunk
            context += start + chunk
            if window is not None:
                windowed += min(start + chunk, window)
            pairs += DecodeRoofline.prefill_attended_pairs(start, chunk)

        if tokens == 0:
            self._unblock()
            return False

        roofline = self.roofline
        if self._read_shared_once and self._prefix_holder_blocks:
            # Cascade attention reads each shared prefix block once, not once per sequence using it.
            duplicate = (self._prefix_holder_blocks - self.prefix_in_use_blocks) * self.block_size
            context = max(0, context - duplicate)
            windowed = max(0, windowed - duplicate)
        kv_bytes = roofline.kv_bytes_of_contexts(context, windowed if window is not None else context)
        duration = roofline.step_time_s(tokens, kv_bytes, pairs)
        above = config.fault_above_running
        if above is not None and len(running) > above:
            duration *= config.fault_step_slowdown
        if self._noise_sigma:
            sigma = self._noise_sigma
            duration *= math.exp(self._noise_rng.gauss(-sigma * sigma / 2.0, sigma))
        end = self.now + duration

        stats.steps += 1
        stats.busy_time_s += duration
        stats.read_bytes += roofline.weight_bytes_read_per_gpu(tokens) + kv_bytes
        stats.running_seconds += len(running) * duration
        stats.in_system_seconds += (len(running) + len(waiting)) * duration
        stats.computed_tokens += tokens
        stats.iteration_tokens.observe(tokens)
        if self.step_end_times is not None:
            self.step_end_times.append(end)

        if n:
            stats.generation_tokens += n
            stats.itl.observe(duration, n)
            self._dec_computed += n
            if window is not None:
                self._dec_windowed += self._dec_below_window
            done = self._finish_at.pop(s, None)
            if done:
                for request in done:
                    if (
                        request.state == DECODE
                        and request.join_step + request.output - request.generated == s
                    ):
                        self._leave_decode(request, s + 1)
                        self._release(request)
                        self._finish(request, end)

        for request, chunk in scheduled:
            request.computed += chunk
            if request.computed == request.prompt + request.generated:
                request.generated += 1
                stats.generation_tokens += 1
                if request.generated == 1:
                    request.first_token_time = end
                    stats.ttft.observe(end - request.arrival)
                    stats.prompt_tokens += request.prompt
                else:  # resumed after preemption: the gap since its last token
                    assert request.last_token_time is not None
                    stats.itl.observe(end - request.last_token_time)
                request.last_token_time = end
                request.segment_start = s
                del self.prefilling[request.id]
                if request.generated >= request.output:
                    if request.segments is not None:
                        request.segments.append((s, s))
                    self._release(request)
                    self._finish(request, end)
                else:
                    self._join_decode(request, s)

        self.now = end
        self.last_step_s = duration
        self.step_index = s + 1
        if self.step_hook is not None:
            self.step_hook(self, duration, tokens, n)
        return True

    # --- scheduling pieces ---------------------------------------------------------------------

    def _chunk_for(self, request: Request, budget: int) -> int:
        """The next prefill chunk of a running, partially computed request, within the budget and,
        when the pool is short, within the blocks still free."""
        chunk = min(request.prompt + request.generated - request.computed, budget)
        if self._reserve:
            return chunk
        bs = self.block_size
        held = request.shared_blocks + request.private_blocks
        need = max(0, -(-(request.computed + chunk) // bs) - held)
        free = self.free_blocks
        if need > free:
            chunk = (held + free) * bs - request.computed
            if chunk <= 0:
                return 0
            need = free
        if need:
            self._allocate(need)
            request.private_blocks += need
        return chunk

    def _admit(self, request: Request, budget: int) -> int:
        """Admit the head of the queue with its first chunk if the pool has room; 0 if not."""
        bs = self.block_size
        k = request.shared_blocks
        total = request.prompt + request.generated
        hit = min(self.prefix_cached_blocks, k)
        computed = hit * bs
        chunk = min(total - computed, budget)
        if self._reserve:
            private = max(0, -(-(request.prompt + request.output - 1) // bs) - k)
        else:
            private = max(0, -(-(computed + chunk) // bs) - k)
        new_prefix = max(0, k - self.prefix_cached_blocks)
        reactivated = max(0, hit - self.prefix_in_use_blocks)
        if new_prefix + private > self.free_blocks - reactivated:
            return 0
        stats = self.stats
        if self.config.enable_prefix_caching:
            stats.prefix_cache_queries += total
            stats.prefix_cache_hits += computed
        if k:
            self._ref_prefix(k)
            request.holds_prefix = True
        if private:
            self._allocate(private)
        request.private_blocks = private
        request.computed = computed
        request.state = PREFILL
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.now
        self.running[request.id] = request
        self.prefilling[request.id] = request
        return chunk

    def _unblock(self) -> None:
        """Nothing fits: preempt the newest running request, or turn away a request no empty pool
        could start."""
        if self.running:
            _, victim = self.running.popitem()
            self._preempt(victim, self.step_index)
        elif self.waiting:
            self._reject(self.waiting.popleft(), self.now)

    def _preempt_for_decode(self, need: int, s: int) -> int:
        """Preempt the newest running requests until the decode group's new blocks fit; returns the
        blocks still needed (victims that needed one no longer do)."""
        phase = -s % self.block_size
        while need > self.free_blocks and self.running:
            _, victim = self.running.popitem()
            if victim.state == DECODE and victim.phase == phase:
                need -= 1
            self._preempt(victim, s)
        return need

    def _preempt(self, victim: Request, s: int) -> None:
        if victim.state == DECODE:
            self._leave_decode(victim, s)
            victim.last_token_time = self.now  # its last token came at the end of the previous step
        else:
            self.prefilling.pop(victim.id, None)
        self.stats.recomputed_tokens += victim.computed
        self._release(victim)
        victim.computed = 0
        victim.state = WAITING
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)

    def _join_decode(self, request: Request, s: int) -> None:
        """After step `s` sampled its token: from step s + 1 it decodes one token per step."""
        request.state = DECODE
        request.join_step = s
        computed = request.computed  # = prompt + generated − 1: the newest token is not yet in the cache
        self.num_decoding += 1
        self._dec_computed += computed
        if not self._reserve:
            phase = (computed - s - 1) % self.block_size
            request.phase = phase
            self._phase_counts[phase] += 1
        finish = s + request.output - request.generated
        bucket = self._finish_at.get(finish)
        if bucket is None:
            self._finish_at[finish] = [request]
        else:
            bucket.append(request)
        window = self._window
        if window is not None:
            self._dec_windowed += min(computed, window)
            if computed < window:
                cross = s + 1 + window - computed
                request.cross_step = cross
                self._dec_below_window += 1
                self._cross_at[cross] = self._cross_at.get(cross, 0) + 1
            else:
                request.cross_step = -1

    def _leave_decode(self, request: Request, s_ref: int) -> None:
        """Take a decoding request out of the group before step `s_ref`, making its counts live."""
        generated = request.generated + (s_ref - request.join_step - 1)
        computed = request.prompt + generated - 1
        request.generated = generated
        request.computed = computed
        self.num_decoding -= 1
        self._dec_computed -= computed
        if not self._reserve:
            self._phase_counts[request.phase] -= 1
            held = -(-computed // self.block_size)
            request.private_blocks = max(0, held - request.shared_blocks)
        window = self._window
        if window is not None:
            self._dec_windowed -= min(computed, window)
            cross = request.cross_step
            if cross >= s_ref:
                left = self._cross_at.get(cross, 0)
                if left > 0:
                    if left == 1:
                        del self._cross_at[cross]
                    else:
                        self._cross_at[cross] = left - 1
                if cross > s_ref:
                    self._dec_below_window -= 1
        if request.segments is not None:
            request.segments.append((request.segment_start, s_ref - 1))
        request.state = PREFILL  # out of the group; the caller sets the real state

    def _finish(self, request: Request, time: float) -> None:
        request.state = FINISHED
        request.finish_time = time
        self.running.pop(request.id, None)
        stats = self.stats
        stats.finished += 1
        stats.success_by_reason[request.finish_reason] = (
            stats.success_by_reason.get(request.finish_reason, 0) + 1
        )
        stats.e2e.observe(time - request.arrival)
        stats.request_prompt_tokens.observe(request.prompt)
        stats.request_generation_tokens.observe(request.output)
        if request.first_scheduled_time is not None:
            stats.queue_time.observe(request.first_scheduled_time - request.arrival)
        tpot = request.tpot_s
        if tpot is not None:
            stats.request_tpot.observe(tpot)
        if request.closed_loop and self.load is not None:
            self.load.request_done(time)
        if self.on_finish is not None:
            self.on_finish(request)

    # --- KV blocks -----------------------------------------------------------------------------

    def _allocate(self, blocks: int) -> None:
        """Take `blocks` free blocks, evicting cached-but-unreferenced prefix blocks when no empty
        block is left (newest prefix blocks first, so the cached prefix stays contiguous)."""
        empty = self.total_blocks - self.used_private_blocks - self.prefix_cached_blocks
        if blocks > empty:
            self.prefix_cached_blocks -= blocks - empty
            assert self.prefix_cached_blocks >= self.prefix_in_use_blocks, "allocated past the free blocks"
        self.used_private_blocks += blocks

    def _release(self, request: Request) -> None:
        self.used_private_blocks -= request.private_blocks
        request.private_blocks = 0
        if request.holds_prefix:
            request.holds_prefix = False
            refs = self._prefix_refs
            k = request.shared_blocks
            refs[k] -= 1
            self._prefix_holder_blocks -= k
            if k == self.prefix_in_use_blocks and refs[k] == 0:
                z = k
                while z > 0 and refs[z] == 0:
                    z -= 1
                self.prefix_in_use_blocks = z

    def _ref_prefix(self, k: int) -> None:
        self._prefix_refs[k] += 1
        self._prefix_holder_blocks += k
        if k > self.prefix_in_use_blocks:
            self.prefix_in_use_blocks = k
        if k > self.prefix_cached_blocks:
            self.prefix_cached_blocks = k

    def check_invariants(self) -> None:
        """Recount what the incremental bookkeeping claims (O(running)); for tests."""
        assert 0 <= self.used_blocks <= self.total_blocks, (self.used_blocks, self.total_blocks)
        assert self.prefix_in_use_blocks <= self.prefix_cached_blocks
        assert self.used_private_blocks + self.prefix_cached_blocks <= self.total_blocks
        assert len(self.running) <= self.config.max_num_seqs
        # Above the live cap only while draining down from a lowered one, and never above the batch
        # that was running when it was lowered.
        assert self._live_cap <= self._allowance <= self.config.max_num_seqs
        assert len(self.running) <= self._allowance, (len(self.running), self._allowance)
        decoding = [r for r in self.running.values() if r.state == DECODE]
        assert len(decoding) == self.num_decoding
        s = self.step_index
        bs = self.block_size
        private = 0
        computed_sum = 0
        for request in self.running.values():
            if request.state == DECODE:
                generated = request.generated + (s - request.join_step - 1)
                computed = request.prompt + generated - 1
                computed_sum += computed
                held = (
                    request.shared_blocks + request.private_blocks
                    if self._reserve
                    else max(request.shared_blocks, -(-computed // bs))
                )
                assert generated < request.output
            else:
                held = request.shared_blocks + request.private_blocks
                assert held * bs >= request.computed
            private += held - request.shared_blocks
        assert private == self.used_private_blocks, (private, self.used_private_blocks)
        assert computed_sum == self._dec_computed
        window = self._window
        if window is not None:
            computed_of = [
                r.prompt + r.generated + (s - r.join_step - 1) - 1
                for r in self.running.values()
                if r.state == DECODE
            ]
            assert sum(min(c, window) for c in computed_of) == self._dec_windowed
            # Sequences reaching the window before step s are still counted until step s starts.
            below = self._dec_below_window - self._cross_at.get(s, 0)
            assert sum(1 for c in computed_of if c < window) == below
