"""The demo's traffic: phases whose average context per running sequence is 512, 2,048 and 8,192.

A request's KV grows from its prompt to prompt + output while it decodes, so the running sequences
hold prompt + E[output²] / (2·E[output]) tokens on average (time-weighted: long answers run
longer). Output lengths are spread uniformly (±50 %) so requests do not finish in lockstep, and
each phase keeps more requests in flight per pod (a closed loop, like a pool of clients) than the
knee, so the batch limit binds. Requests are decode-heavy, so TPOT shows the batch's KV reads
rather than the prefill chunks riding along.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

OUTPUT_SPREAD = 0.5  # outputs uniform in [0.5, 1.5] × the mean


@dataclass(frozen=True)
class Phase:
    name: str
    target_context: int
    output_tokens: int  # mean
    concurrency: int  # requests in flight per pod
    duration_s: float
    prefix_sharing: float = 0.0  # the share of each prompt all requests share (a system prompt)

    @property
    def prompt_tokens(self) -> int:
        """The prompt that puts the running sequences' average context at the target."""
        decode_share = self.output_tokens * (0.5 + OUTPUT_SPREAD**2 / 6)
        return round(self.target_context - decode_share)

    def load(self) -> dict[str, object]:
        """The emulators' load (their --load-file / POST /load JSON)."""
        return {
            "concurrency": self.concurrency,
            "promptTokens": self.prompt_tokens,
            "outputTokens": self.output_tokens,
            "outputDistribution": "uniform",
            "outputSpread": OUTPUT_SPREAD,
            **({"prefixSharing": self.prefix_sharing} if self.prefix_sharing else {}),
        }


@dataclass(frozen=True)
class Scenario:
    name: str
    phases: tuple[Phase, ...]
    sample_interval_s: float
    speedup: float  # simulated seconds per wall second in the emulators
    # After a phase's duration, up to this long more while an Auto LLMServing is still converging
    # (rolling, settling, holding a shift long enough): a slow machine delays the loop's reaction,
    # and a phase cut short mid-rollout shows a timing, not what the loop converges to.
    converge_grace_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return sum(phase.duration_s for phase in self.phases)


def _phases(*durations_s: float) -> tuple[Phase, ...]:
    # Longer contexts mean longer requests, so traffic takes longer to shift: later phases run longer.
    short, middle, long = durations_s
    return (
        Phase("ctx-512", 512, output_tokens=512, concurrency=256, duration_s=short),
        Phase("ctx-2048", 2048, output_tokens=2048, concurrency=96, duration_s=middle),
        Phase("ctx-8192", 8192, output_tokens=6144, concurrency=48, duration_s=long),
    )


# The emulators run 20× faster than real time, so a 6,144-token answer at 8,192 tokens of context
# finishes (and drains) in seconds; latencies stay in simulated GPU seconds, and throughput is
# reported per simulated second.
FULL = Scenario("full", _phases(150.0, 170.0, 190.0), sample_interval_s=5.0, speedup=20.0)
FAST = Scenario(
    "fast", _phases(75.0, 110.0, 150.0), sample_interval_s=4.0, speedup=20.0, converge_grace_s=90.0
)
# The fast scenario with 60 % of every prompt shared (SGLang's radix cache holds it once).
FAST_SHARED = Scenario(
    "fast-shared",
    tuple(replace(phase, prefix_sharing=0.6) for phase in FAST.phases),
    sample_interval_s=FAST.sample_interval_s,
    speedup=FAST.speedup,
    converge_grace_s=FAST.converge_grace_s,
)
