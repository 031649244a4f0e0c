"""A client outside the pods: the real `openai` client keeps several streamed completions in flight
against an LLMServing, the way a router sends traffic where there is no kube-proxy: it reads where
the engine Service routes (its EndpointSlices' Ready endpoints, or on loopback pod addresses the
Ready pods), re-reads that as it changes, and round-robins across it per request. A pod that leaves
keeps the requests it holds: they finish there while it drains. It records each request's TTFT,
inter-token latency and errors, and the endpoint sets it saw.

At 20× real time a 256-token stream lasts a third of a wall second: when the client's own event loop
wakes late (a busy machine, another thread holding the GIL), the tokens that arrived meanwhile are
read in one burst. A stall that delays the read of a request's first or last token moves its TPOT
(last − first) by the delay: the client watches its own loop and marks those requests. A stall in
between moves neither read.

The demo's bulk traffic stays inside the emulators (a Python client cannot parse hundreds of
streams at 20× real time on a small machine); this client rides along at the phase's prompt length.
Latencies are converted to simulated seconds (wall × speedup), like the emulators' histograms.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import openai

REFRESH_S = 0.5  # how often the endpoints are re-read (the pods' preStop hook covers the staleness)
DEFAULT_CONCURRENCY = 6  # streams in flight: what one Python client keeps up with at 20× on 2 cores
REQUEST_TIMEOUT_S = 120.0
MAX_ERROR_CHARS = 300
LAG_PROBE_S = 0.005  # how often the client checks its own loop for late wake-ups
LAG_NOTED_S = 0.01  # late wake-ups of this much (wall) or more are noted
# A read delayed this much marks its request: at 20× it moves a 256-token request's mean ITL by 20 ms
# simulated, near a whole TPOT. Shorter delays (in an e2e run on 2 cores the client's loop waits
# 0.1 s or more about half the time) move a request's figure either way and average out over a
# window's requests: measured, the mean of the unmarked requests stays within 10 % of the engines'.
STALL_S = 0.25
# After a stall the loop works through what piled up: reads in that turn come after the stall's end.
STALL_BACKLOG_S = 0.05

Endpoints = Callable[[], list[tuple[str, str]]]  # → [(pod name, base URL)] where the Service routes


@dataclass
class ClientRecord:
    phase: str
    pod: str
    started_at: float  # wall clock, epoch seconds
    tokens: int
    ttft_s: float | None  # simulated seconds
    tpot_s: float | None  # simulated seconds: (last token − first token) / (tokens − 1), the mean ITL
    error: str | None
    drained: bool = False  # its pod left the endpoints while the request was in flight
    first_token_at: float | None = None  # wall clock, when the client read the first token
    last_token_at: float | None = None  # wall clock, when it read the last
    stall_s: float = 0.0  # how long a stall of the client's loop delayed its first or last read (wall)
    stalled: bool = False  # that was STALL_S or more: its TPOT measured the client (set by `mark_stalls`)


class ExternalClient:
    """Runs its own asyncio loop in a thread: `start()`, `set_phase()` as the traffic moves, `stop()`."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        model: str,
        speedup: float,
        routing: str = "",
        concurrency: int = DEFAULT_CONCURRENCY,
        max_tokens: int = 256,
    ) -> None:
        self.endpoints = endpoints
        self.routing = routing  # how `endpoints` finds them, for the report
        self.model = model
        self.speedup = speedup
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.records: list[ClientRecord] = []
        self.slowest_refresh_s = 0.0  # the longest look at the Ready pods: how stale routing can get
        self.stalls: list[tuple[float, float]] = []  # (wall from, wall until) the loop woke late
        self._phase = ""
        self._prompt_tokens = 0
        self._ready: list[tuple[str, str]] = []
        self.endpoint_sets: list[tuple[float, list[str]]] = []  # (wall time, pods) at each change
        self._left: dict[str, float] = {}  # pod → when (monotonic) it last left the endpoints
        self._turns = itertools.count()  # one round robin over all requests, as a router keeps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="external-client", daemon=True)
        # The endpoints are followed on a thread of their own: on the streams' event loop, in a
        # busy e2e run, a 0.5-s sleep woke 2 s late and the routing lagged past the pods' preStop
        # sleep (requests went to draining pods and got 503).
        self._follower = threading.Thread(target=self._follow, name="external-client-endpoints", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None  # the streams' loop, once started

    def set_phase(self, name: str, prompt_tokens: int) -> None:
        self._phase, self._prompt_tokens = name, prompt_tokens

    def start(self) -> None:
        self._follower.start()
        self._thread.start()

    def stop(self, timeout_s: float = REQUEST_TIMEOUT_S + 10) -> None:
        """Stop sending; the requests in flight finish (bounded by their timeout)."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._follower.join(timeout_s)

    def mark_stalls(self) -> None:
        """Flags each request whose first or last token was read late by a stall of the client's loop."""

        def delay(read_at: float) -> float:
            # (the probe notes a stall's end in the turn that reads what piled up, either side of it)
            return max(
                (
                    until - since
                    for since, until in self.stalls
                    if since <= read_at <= until + STALL_BACKLOG_S
                ),
                default=0.0,
            )

        for record in self.records:
            if record.first_token_at is None or record.last_token_at is None:
                continue
            record.stall_s = round(max(delay(record.first_token_at), delay(record.last_token_at)), 4)
            record.stalled = record.stall_s >= STALL_S

    def write_report(self, path: Path) -> None:
        self.mark_stalls()
        errors = [r for r in self.records if r.error]
        report = {
            "routing": self.routing,
            "concurrency": self.concurrency,
            "requests": len(self.records),
            "errors": len(errors),
            **latencies(self.records),
            "finishedOnDrainingPods": sum(1 for r in self.records if r.drained and not r.error),
            "stalledRequests": sum(1 for r in self.records if r.stalled),
            "longestStallSeconds": round(max((u - s for s, u in self.stalls), default=0.0), 3),
            "stalls": [[round(s, 3), round(u, 3)] for s, u in self.stalls if u - s >= STALL_S],
            "slowestRefreshSeconds": round(self.slowest_refresh_s, 3),
            "endpointSets": [{"at": round(at, 3), "pods": pods} for at, pods in self.endpoint_sets],
            "byPhase": {
                phase: {
                    "requests": sum(1 for r in self.records if r.phase == phase),
                    "errors": sum(1 for r in errors if r.phase == phase),
                    **latencies([r for r in self.records if r.phase == phase]),
                }
                for phase in dict.fromkeys(r.phase for r in self.records)
            },
            "records": [asdict(r) for r in self.records],
        }
        path.write_text(json.dumps(report, indent=1) + "\n")

    # --- the loop ----------------------------------------------------------------------------

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        self.loop = asyncio.get_running_loop()
        # Loopback only: never through a proxy from the environment.
        http = openai.DefaultAsyncHttpxClient(trust_env=False, timeout=REQUEST_TIMEOUT_S)
        clients: dict[str, openai.AsyncOpenAI] = {}

        def client_for(url: str) -> openai.AsyncOpenAI:
            if url not in clients:
                clients[url] = openai.AsyncOpenAI(
                    base_url=f"{url}/v1", api_key="unused", http_client=http, max_retries=0
                )
            return clients[url]

        workers = [asyncio.create_task(self._worker(client_for)) for _ in range(self.concurrency)]
        await asyncio.gather(self._watch_own_loop(), *workers)
        await http.aclose()

    async def _watch_own_loop(self) -> None:
        while not self._stop.is_set():
            due = time.monotonic() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            late = time.monotonic() - due
            if late >= LAG_NOTED_S:
                now = time.time()
                self.stalls.append((now - late, now))

    def _follow(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            with contextlib.suppress(Exception):  # a failed read keeps the last known endpoints
                self._note(self.endpoints())
            self.slowest_refresh_s = max(self.slowest_refresh_s, time.monotonic() - began)
            self._stop.wait(REFRESH_S)

    def _note(self, ready: list[tuple[str, str]]) -> None:
        pods = sorted(pod for pod, _url in ready)
        if not self.endpoint_sets or self.endpoint_sets[-1][1] != pods:
            self.endpoint_sets.append((time.time(), pods))
            now = time.monotonic()
            for pod, _url in self._ready:
                if pod not in pods:
                    self._left[pod] = now
        self._ready = ready

    async def _worker(self, client_for: Callable[[str], openai.AsyncOpenAI]) -> None:
        while not self._stop.is_set():
            ready, phase, prompt = self._ready, self._phase, self._prompt_tokens
            if not ready or not prompt:
                await asyncio.sleep(0.2)
                continue
            pod, url = ready[next(self._turns) % len(ready)]
            self.records.append(await self._one(client_for(url), pod, phase, prompt))

    async def _one(
        self, client: openai.AsyncOpenAI, pod: str, phase: str, prompt_tokens: int
    ) -> ClientRecord:
        started_at, started = time.time(), time.monotonic()
        arrivals: list[float] = []
        error = None
        try:
            # The raw event stream (the client's HTTP and SSE framing, no model object per chunk):
            # at 20× real time a stream carries hundreds of tokens a second, and a client that
            # cannot keep up measures its own lag as TPOT.
            async with client.completions.with_streaming_response.create(
                model=self.model, prompt=[1] * prompt_tokens, max_tokens=self.max_tokens, stream=True
            ) as response:
                async for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue  # blank separators and the final [DONE]
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        error = f"error event: {event['error']}"[:MAX_ERROR_CHARS]
                    elif event.get("choices") and event["choices"][0].get("text"):
                        arrivals.append(time.monotonic())
            if error is None and len(arrivals) != self.max_tokens:
                error = f"the stream ended after {len(arrivals)} of {self.max_tokens} tokens"
        except (openai.OpenAIError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        scale = self.speedup
        ttft = (arrivals[0] - started) * scale if arrivals else None
        tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * scale if len(arrivals) > 1 else None
        drained = self._left.get(pod, -1.0) > started
        first_at, last_at = (
            (started_at + arrivals[0] - started, started_at + arrivals[-1] - started)
            if arrivals
            else (None, None)
        )
        return ClientRecord(
            phase, pod, started_at, len(arrivals), ttft, tpot, error, drained, first_at, last_at
        )


def latencies(records: list[ClientRecord]) -> dict[str, float | None]:
    """Median and p99 TTFT and inter-token latency (per-request mean ITL, of the requests whose
    tokens were read without a stall of the client's own loop), in simulated ms."""
    out: dict[str, float | None] = {}
    for key, values in (
        ("ttft", [r.ttft_s for r in records if r.ttft_s is not None and not r.error]),
        ("itl", [r.tpot_s for r in records if r.tpot_s is not None and not r.error and not r.stalled]),
    ):
        ms = sorted(v * 1e3 for v in values)
        out[f"{key}P50Ms"] = round(statistics.median(ms), 2) if ms else None
        out[f"{key}P99Ms"] = round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2) if ms else None
    return out
