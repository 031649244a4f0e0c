"""`batchknee emulate`: the simulation in real time behind an engine's HTTP surface.

A wall-clock adapter drives the pure `Engine`: simulated time = (wall − ready) × speedup, and every
scrape or request first runs the engine up to now. Serves `/health` (200 once the startup delay
has passed), `/metrics` (vLLM text; for TensorRT-LLM the JSON iteration stats, with the Prometheus
text at `/prometheus/metrics`), `GET/POST /load`, `POST /v1/completions` and
`/v1/chat/completions` (a real request that answers when it finishes or, with `stream: true`,
streams server-sent events token by token as the simulation produces them, each sent when its
simulated time comes on the scaled wall clock), `/v1/models`, `/version`.
With `--emulator-runtime-config` (vLLM PR #54816, dev mode) `GET/PATCH /v1/runtime_config`, with
`--emulator-trimtab` `POST /trimtab/set_knobs` and `GET /trimtab/knobs`: the live batch cap, under
the startup `--max-num-seqs`; without them (and always for TensorRT-LLM) those paths answer 404.

SIGTERM drains: the built-in load stops, new requests get 503, queued and running requests finish
within `--drain-grace-s` wall seconds; whatever is left is counted as dropped; exit status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from batchknee.emulator.engine import DROPPED, FINISHED, REJECTED, Engine, Request, StepHook
from batchknee.emulator.engine_args import EmulatorSettings
from batchknee.emulator.metrics import (
    EmulatorCollector,
    EmulatorState,
    SglangCollector,
    TrtllmCollector,
    VllmCollector,
    build_registry,
    trtllm_iteration_stats,
)
from batchknee.emulator.workload import LoadError, LoadSpec
from batchknee.engines import sglang, trtllm, vllm

MAX_STEPS_PER_SYNC = 2_000
LOAD_FILE_POLL_S = 0.5
MAX_WAKE_S = 0.25
MIN_WAKE_S = 0.001
EMULATOR_VERSION = "0.11.0+batchknee.emulator"


@dataclass
class _Waiter:
    future: asyncio.Future[Request]


@dataclass
class _Stream:
    """A streamed request: the output tokens the simulation produced, with their simulated times,
    and how many of them are due on the scaled wall clock (the handler sends those)."""

    request: Request
    produced: int = 0
    due: int = 0
    pending: deque[tuple[float, int]] = field(default_factory=deque)  # (simulated time, tokens so far)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False  # dropped or turned away: no more tokens will come


class EmulatorServer:
    def __init__(
        self,
        settings: EmulatorSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        log: TextIO | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.log = log or sys.stderr
        self.out = out or sys.stdout
        self.state = EmulatorState()
        step_hook: StepHook = self._on_step
        self.engine = Engine(
            settings.config,
            load=settings.load,
            seed=settings.seed,
            on_finish=self._on_finish,
            step_hook=step_hook,
        )
        self.ready = False
        self.draining = False
        self._wall0 = 0.0
        self._deadline = math.inf
        self._done = asyncio.Event()
        self._wake = asyncio.Event()
        self._responses: list[tuple[float, int, Request]] = []
        self._streams: dict[int, _Stream] = {}  # by engine request id
        self._load_file_key: tuple[int, int] | None = None
        self._load_source = "command line"
        self.port: int | None = None
        model = settings.served_model_name
        info = {
            "engine": settings.engine,
            "model": settings.model,
            "gpu": settings.gpu,
            "speedup": f"{settings.speedup:g}",
            "metric_version": settings.metric_version,
        }
        emulator = EmulatorCollector(self.engine, model, self.state, info)
        if settings.engine == "vllm":
            engine_collector: VllmCollector | TrtllmCollector | SglangCollector = VllmCollector(
                self.engine,
                model,
                settings.metric_version,
                settings.cache_info,
                settings.mfu_metrics,
                speedup=settings.speedup,
            )
        elif settings.engine == "sglang":
            engine_collector = SglangCollector(
                self.engine,
                model,
                settings.config.block_size,
                settings.mfu_metrics,
                speedup=settings.speedup,
                tensor_parallel=settings.config.roofline.tensor_parallel,
                all_schedulers=settings.metrics_for_all_schedulers,
                priority_scheduling=settings.priority_scheduling,
            )
        else:
            engine_collector = TrtllmCollector(
                self.engine, model, settings.cache_info, settings.config.max_num_batched_tokens
            )
        self.registry = build_registry([engine_collector, emulator])

    # --- the clock adapter ---------------------------------------------------------------------

    def sim_now(self) -> float:
        if not self.ready:
            return 0.0
        return (self.clock() - self._wall0) * self.settings.speedup

    def sync(self) -> None:
        """Run the engine up to the scaled wall clock (bounded work per call) and answer the HTTP
        requests whose last token time has come."""
        if not self.ready:
            return
        target = self.sim_now()
        self.engine.run_until(target, max_steps=MAX_STEPS_PER_SYNC)
        self.state.simulated_s = target
        busy = not self.engine.idle
        self.state.lag_s = max(0.0, target - self.engine.now) if busy else 0.0
        responses = self._responses
        while responses and responses[0][0] <= target:
            request = heapq.heappop(responses)[2]
            waiter = request.tag
            if isinstance(waiter, _Waiter) and not waiter.future.done():
                waiter.future.set_result(request)
        for stream in self._streams.values():
            pending = stream.pending
            if pending and pending[0][0] <= target:
                while pending and pending[0][0] <= target:
                    stream.due = pending.popleft()[1]
                stream.changed.set()

    def _on_step(self, engine: Engine, duration: float, tokens: int, decoded: int) -> None:
        """After each engine step: note the new output tokens of the streamed requests, due at the
        step's end (O(streams) per step; the built-in load does not stream)."""
        for stream in self._streams.values():
            produced = engine.tokens_generated(stream.request)
            if produced > stream.produced:
                stream.pending.append((engine.now, produced))
                stream.produced = produced

    def _on_finish(self, request: Request) -> None:
        waiter = request.tag
        if isinstance(waiter, _Stream):
            if request.state != FINISHED:
                waiter.ended = True
                waiter.changed.set()
            return
        if not isinstance(waiter, _Waiter):
            return
        if request.state == FINISHED and request.finish_time is not None:
            heapq.heappush(self._responses, (request.finish_time, request.id, request))
        elif not waiter.future.done():
            waiter.future.set_result(request)

    def _wake_delay(self) -> float:
        """Wall seconds until the next thing that changes what the emulator shows."""
        if not self.ready:
            return MAX_WAKE_S
        now = self.sim_now()
        engine = self.engine
        if engine.idle:
            upcoming = engine.next_arrival_time()
        else:
            if engine.now < now:  # behind: catch up at once
                return 0.0
            upcoming = engine.now
        if self._responses:
            upcoming = min(upcoming, self._responses[0][0])
        for stream in self._streams.values():
            if stream.pending:
                upcoming = min(upcoming, stream.pending[0][0])
        if upcoming == math.inf:
            return MAX_WAKE_S
        return min(MAX_WAKE_S, max(MIN_WAKE_S, (upcoming - now) / self.settings.speedup))

    # --- lifecycle -----------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        print(f"batchknee emulate: {message}", file=self.log, flush=True)

    def _become_ready(self) -> None:
        self._apply_load_file(initial=True)
        self.ready = True
        self._wall0 = self.clock()
        self._say("ready")

    def begin_drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        self.state.draining = True
        if not self.ready:
            self._say("SIGTERM before ready: exiting")
            self._done.set()
            return
        self.sync()
        self.engine.stop_load()
        self._deadline = self.clock() + self.settings.drain_grace_s
        self._say(
            f"draining: {self.engine.in_flight} requests in flight, grace {self.settings.drain_grace_s:g} s"
        )
        self._wake.set()

    def _drain_finished(self) -> bool:
        if self.engine.in_flight == 0 and not self._responses and not self._streams:
            self._say(f"drained: every request finished ({self.engine.stats.finished} in all)")
            return True
        if self.clock() >= self._deadline:
            self.sync()
            dropped = self.engine.drop_all()
            for _, _, request in self._responses:
                waiter = request.tag
                if isinstance(waiter, _Waiter) and not waiter.future.done():
                    waiter.future.set_result(request)
            self._responses.clear()
            for stream in self._streams.values():
                stream.ended = True
                stream.changed.set()
            self._say(f"drain grace ran out: dropped {dropped} requests")
            return True
        return False

    async def _pump(self) -> None:
        while not self._done.is_set():
            self.sync()
            if self.draining and self._drain_finished():
                break
            delay = self._wake_delay()
            if self.draining:
                delay = min(delay, max(MIN_WAKE_S, self._deadline - self.clock()))
            if delay <= 0.0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            self._wake.clear()
        if self.draining and self.settings.drain_linger_s > 0 and not self._done.is_set():
            await asyncio.sleep(self.settings.drain_linger_s)
        self._done.set()

    async def _watch_load_file(self) -> None:
        while not self._done.is_set():
            await asyncio.sleep(LOAD_FILE_POLL_S)
            if self.ready and not self.draining:
                self._apply_load_file(initial=False)

    def _apply_load_file(self, *, initial: bool) -> None:
        path = self.settings.load_file
        if path is None:
            return
        try:
            stat = os.stat(path)
        except OSError:
            return
        key = (stat.st_mtime_ns, stat.st_size)
        if key == self._load_file_key:
            return
        self._load_file_key = key
        try:
            document = json.loads(Path(path).read_text())
            spec = self.settings.load.merged(document)
        except (OSError, ValueError) as error:
            self._say(f"--load-file {path}: ignored ({error})")
            return
        self.sync()
        self.engine.set_load(spec, at=self.engine.now if initial else self.sim_now())
        self._load_source = f"load file {path}"
        self._say(f"load from {path}: {json.dumps(spec.to_json())}")
        self._wake.set()

    async def serve(self) -> int:
        app = self.make_app()
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.host, self.settings.port)
        try:
            await site.start()
        except OSError as error:
            self._say(f"cannot listen on {self.settings.host}:{self.settings.port}: {error.strerror}")
            await runner.cleanup()
            return 1
        sockets = getattr(site._server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.settings.port
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.begin_drain)
        for line in self.settings.warnings:
            self._say(f"warning: {line}")
        for flag in self.settings.ignored:
            self._say(f"warning: ignoring engine flag {flag}")
        self._say(self.settings.describe())
        self._say(f"listening on http://{self.settings.host}:{self.port}")
        tasks = [asyncio.create_task(self._start_after_delay()), asyncio.create_task(self._watch_load_file())]
        pump = asyncio.create_task(self._pump())
        await self._done.wait()
        for task in (*tasks, pump):
            task.cancel()
        for task in (*tasks, pump):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        summary = self.summary()
        text = json.dumps(summary, sort_keys=True)
        print(text, file=self.out, flush=True)
        if self.settings.summary_file is not None:
            with contextlib.suppress(OSError):
                self.settings.summary_file.write_text(text + "\n")
        await runner.cleanup()
        return 0

    async def _start_after_delay(self) -> None:
        await asyncio.sleep(self.settings.startup_delay_s)
        if not self.draining:
            self._become_ready()
            self._wake.set()

    def summary(self) -> dict[str, Any]:
        stats = self.engine.stats
        return {
            "event": "exit",
            "engine": self.settings.engine,
            "model": self.settings.served_model_name,
            "maxNumSeqs": self.settings.config.max_num_seqs,
            "liveMaxNumSeqs": self.engine.live_max_num_seqs,
            "received": stats.received,
            "finished": stats.finished,
            "rejected": stats.rejected,
            "dropped": stats.dropped,
            "preemptions": stats.preemptions,
            "simulatedSeconds": self.state.simulated_s,
        }

    # --- HTTP ----------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        routes = [
            web.get(vllm.HTTP.health_path, self.health),  # every engine's readiness path
            web.get("/load", self.get_load),
            web.post("/load", self.post_load),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/version", self.version),
        ]
        if self.settings.engine == "vllm":
            routes.append(web.get(vllm.HTTP.metrics_path, self.prometheus_metrics))
        elif self.settings.engine == "sglang":
            routes += [
                web.get(sglang.HTTP.metrics_path, self.prometheus_metrics),
                web.get("/get_server_info", self.sglang_server_info),
                web.post("/generate", self.sglang_generate),
            ]
        else:
            routes += [
                web.get(trtllm.HTTP.metrics_path, self.prometheus_metrics),
                web.get(trtllm.JSON_METRICS_PATH, self.trtllm_json_metrics),
            ]
        if self.settings.runtime_config_endpoint:
            routes += [
                web.get("/v1/runtime_config", self.get_runtime_config),
                web.patch("/v1/runtime_config", self.patch_runtime_config),
            ]
        if self.settings.trimtab_endpoint:
            routes += [
                web.post("/trimtab/set_knobs", self.trimtab_set_knobs),
                web.get("/trimtab/knobs", self.trimtab_knobs),
            ]
        app.add_routes(routes)
        return app

    def _unavailable(self) -> web.Response:
        return web.json_response(
            {"error": "draining" if self.draining else "loading model"},
            status=503,
        )

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready or self.draining:
            return self._unavailable()
        return web.Response(status=200)

    async def prometheus_metrics(self, request: web.Request) -> web.Response:
        if not self.ready:
            return self._unavailable()
        self.sync()
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(self.registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    async def trtllm_json_metrics(self, request: web.Request) -> web.Response:
        if not self.ready:
            return self._unavailable()
        self.sync()
        stamp = time.strftime("%m-%d-%Y %H:%M:%S")
        return web.json_response(trtllm_iteration_stats(self.engine, stamp))

    def _load_json(self) -> dict[str, Any]:
        load = self.engine.load
        spec = load.spec if load is not None else self.settings.load
        return {
            **spec.to_json(),
            "active": load is not None and not load.stopped,
            "source": self._load_source,
        }

    async def get_load(self, request: web.Request) -> web.Response:
        return web.json_response(self._load_json())

    async def post_load(self, request: web.Request) -> web.Response:
        if self.draining:
            return self._unavailable()
        try:
            document = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        load = self.engine.load
        current = load.spec if load is not None else self.settings.load
        try:
            spec = current.merged(document)
        except LoadError as error:
            return web.json_response({"error": str(error)}, status=400)
        self.sync()
        self.engine.set_load(spec, at=self.sim_now())
        self._load_source = "POST /load"
        self._wake.set()
        return web.json_response(self._load_json())

    # --- live caps: vLLM PR #54816 and trimtab ---------------------------------------------------

    def _runtime_config_json(self) -> dict[str, Any]:
        return {
            "max_num_running_seqs": self.engine.live_max_num_seqs,
            "max_num_seqs_capacity": self.settings.config.max_num_seqs,
        }

    def _set_live_cap(self, cap: int) -> None:
        """Bring the engine up to now, then set the cap: it binds from the next step on."""
        self.sync()
        self.engine.set_live_max_num_seqs(cap)
        self._say(f"live max-num-seqs {cap} (running {self.engine.num_running})")
        self._wake.set()

    async def get_runtime_config(self, request: web.Request) -> web.Response:
        if not self.ready:
            return self._unavailable()
        return web.json_response(self._runtime_config_json())

    async def patch_runtime_config(self, request: web.Request) -> web.Response:
        if not self.ready:
            return self._unavailable()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _openai_error("the body must be a JSON object", 400)
        if not isinstance(body, dict):
            return _openai_error("the body must be a JSON object", 400)
        unknown = sorted(set(body) - {"max_num_running_seqs"})
        if unknown:
            return _openai_error(
                f"unknown runtime config field(s) {', '.join(unknown)}: only max_num_running_seqs", 400
            )
        ceiling = self.settings.config.max_num_seqs
        cap = body.get("max_num_running_seqs")
        if isinstance(cap, bool) or not isinstance(cap, int):
            return _openai_error(f"max_num_running_seqs must be a whole number from 1 to {ceiling}", 400)
        if not 1 <= cap <= ceiling:
            return _openai_error(
                f"max_num_running_seqs {cap} is outside 1 … {ceiling}: it cannot exceed the startup "
                f"--max-num-seqs ({ceiling}), the capacity the engine allocated",
                400,
            )
        self._set_live_cap(cap)
        return web.json_response(self._runtime_config_json())

    def _trimtab_knobs_json(self) -> dict[str, Any]:
        self.sync()
        engine = self.engine
        budget = self.settings.config.max_num_batched_tokens
        return {
            "max_num_seqs": engine.live_max_num_seqs,
            "max_num_seqs_effective": engine.effective_max_num_seqs,
            "max_num_batched_tokens": budget,
            "running": engine.num_running,
            "ceilings": {"max_num_seqs": self.settings.config.max_num_seqs, "max_num_batched_tokens": budget},
        }

    async def trimtab_knobs(self, request: web.Request) -> web.Response:
        if not self.ready:
            return self._unavailable()
        return web.json_response(self._trimtab_knobs_json())

    async def trimtab_set_knobs(self, request: web.Request) -> web.Response:
        if not self.ready:
            return self._unavailable()
        try:
            knobs = await request.json()
        except (ValueError, UnicodeDecodeError):
            knobs = None
        if not isinstance(knobs, dict):
            return web.json_response(
                {"ok": False, "applied": {}, "rejected": {}, "error": "the body must be a JSON object"},
                status=400,
            )
        ceiling = self.settings.config.max_num_seqs
        applied: dict[str, int] = {}
        rejected: dict[str, str] = {}
        for key, value in knobs.items():
            if key != "max_num_seqs":
                rejected[key] = "not modelled by the emulator (it takes max_num_seqs only)"
            elif isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= ceiling:
                rejected[key] = f"valid range is 1..{ceiling} (the boot allocation)"
            else:
                self._set_live_cap(value)
                applied[key] = value
        ok = not rejected
        return web.json_response(
            {"ok": ok, "applied": applied, "rejected": rejected}, status=200 if ok else 400
        )

    async def models(self, request: web.Request) -> web.Response:
        name = self.settings.served_model_name
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": self.settings.engine,
                        "root": self.settings.model,
                        "max_model_len": self.settings.config.max_model_len,
                    }
                ],
            }
        )

    async def sglang_server_info(self, request: web.Request) -> web.Response:
        """SGLang's `/get_server_info`: the resolved server arguments the pool and batch come from."""
        config, info = self.settings.config, self.settings.cache_info
        return web.json_response(
            {
                "model_path": self.settings.model,
                "served_model_name": self.settings.served_model_name,
                "tp_size": config.roofline.tensor_parallel,
                "max_running_requests": config.max_num_seqs,
                "page_size": config.block_size,
                "mem_fraction_static": float(info["mem_fraction_static"]),
                "max_total_num_tokens": config.num_gpu_blocks * config.block_size,
                "context_length": config.max_model_len,
                "chunked_prefill_size": config.max_num_batched_tokens,
                "disable_radix_cache": not config.enable_prefix_caching,
                "version": sglang.VERSION,
            }
        )

    async def sglang_generate(self, request: web.Request) -> web.Response:
        """SGLang's native `/generate` (`text` or `input_ids`, `sampling_params.max_new_tokens`),
        answered when the request finishes, with SGLang's `meta_info`."""
        if not self.ready or self.draining:
            return self._unavailable()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _openai_error("the body must be a JSON object", 400)
        if not isinstance(body, dict):
            return _openai_error("the body must be a JSON object", 400)
        if body.get("stream"):
            return _openai_error("stream: the emulator's /generate answers whole requests only", 400)
        ids, text = body.get("input_ids"), body.get("text")
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            prompt_tokens = len(ids)
        elif isinstance(text, str) and text:
            prompt_tokens = text_tokens(text)
        else:
            return _openai_error("text: give a non-empty string (or input_ids: a list of token ids)", 400)
        params = body.get("sampling_params") or {}
        max_new = params.get("max_new_tokens", 128) if isinstance(params, dict) else None
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            return _openai_error("sampling_params.max_new_tokens must be a positive integer", 400)
        if prompt_tokens >= self.settings.config.max_model_len:
            return _openai_error(
                f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                f"({self.settings.config.max_model_len} tokens).",
                400,
            )
        self.sync()
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        engine_request = self.engine.submit(prompt_tokens, max_new, at=self.sim_now(), tag=waiter)
        if engine_request.state == REJECTED:
            return _openai_error("the queue is full", 503, "ServiceUnavailableError")
        self._wake.set()
        done = await waiter.future
        if done.state != FINISHED:
            return _openai_error("the request did not finish", 503, "ServiceUnavailableError")
        return web.json_response(
            {
                "text": ("lorem " * done.output).rstrip() if done.output <= 65_536 else "lorem",
                "meta_info": {
                    "id": str(done.id),
                    "prompt_tokens": done.prompt,
                    "completion_tokens": done.output,
                    "finish_reason": {"type": done.finish_reason, "length": done.output},
                    "e2e_latency": done.e2e_s,
                },
            }
        )

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": EMULATOR_VERSION})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        if not self.ready or self.draining:
            return self._unavailable()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _openai_error("the body must be a JSON object", 400)
        if not isinstance(body, dict):
            return _openai_error("the body must be a JSON object", 400)
        model = body.get("model")
        if model is not None and model != self.settings.served_model_name:
            return _openai_error(f"The model `{model}` does not exist.", 404, "NotFoundError")
        try:
            prompt_tokens = _count_prompt_tokens(body, chat)
        except ValueError as error:
            return _openai_error(str(error), 400)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            return _openai_error("max_tokens must be a positive integer", 400)
        limit = self.settings.config.max_model_len
        if prompt_tokens >= limit:
            return _openai_error(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_tokens} input tokens.",
                400,
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return _openai_error("stream must be true or false", 400)
        options = body.get("stream_options")
        if options is not None and not stream:
            return _openai_error("stream_options can only be given with stream: true", 400)
        if options is not None and not isinstance(options, dict):
            return _openai_error("stream_options must be an object", 400)
        include_usage = (options or {}).get("include_usage", False)
        if not isinstance(include_usage, bool):
            return _openai_error("stream_options.include_usage must be true or false", 400)
        if stream:
            return await self._stream(request, prompt_tokens, max_tokens, chat, include_usage)
        self.sync()
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        engine_request = self.engine.submit(prompt_tokens, max_tokens, at=self.sim_now(), tag=waiter)
        if engine_request.state == REJECTED:
            return _openai_error("the queue is full", 503, "ServiceUnavailableError")
        self._wake.set()
        done = await waiter.future
        if done.state == DROPPED:
            return _openai_error(
                "the server shut down before the request finished", 503, "ServiceUnavailableError"
            )
        if done.state != FINISHED:
            return _openai_error("the request was turned away", 503, "ServiceUnavailableError")
        text = ("lorem " * done.output).rstrip() if done.output <= 65_536 else "lorem"
        usage = {
            "prompt_tokens": done.prompt,
            "completion_tokens": done.output,
            "total_tokens": done.prompt + done.output,
        }
        choice: dict[str, Any] = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response(
            {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{done.id}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.settings.served_model_name,
                "choices": [choice],
                "usage": usage,
                "batchknee": {
                    "ttftSeconds": done.ttft_s,
                    "tpotSeconds": done.tpot_s,
                    "e2eSeconds": done.e2e_s,
                    "preemptions": done.preemptions,
                },
            }
        )

    async def _stream(
        self, http_request: web.Request, prompt_tokens: int, max_tokens: int, chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        """Server-sent events as vLLM's OpenAI server sends them: one chunk per output token when it
        is due (chat: the first one also carries the role), the last with its finish_reason, then a
        usage chunk with no choices when `stream_options.include_usage` is set, then `[DONE]`. A
        request dropped by a drain ends with an error event."""
        self.sync()
        engine_request = self.engine.submit(prompt_tokens, max_tokens, at=self.sim_now())
        if engine_request.state == REJECTED:
            return _openai_error("the queue is full", 503, "ServiceUnavailableError")
        stream = _Stream(engine_request)
        engine_request.tag = stream
        self._streams[engine_request.id] = stream
        self._wake.set()
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{engine_request.id}",
            "object": kind,
            "created": int(time.time()),
            "model": self.settings.served_model_name,
        }
        total = engine_request.output
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sent = 0
        try:
            await response.prepare(http_request)
            while sent < total and not (stream.ended and sent >= stream.due):
                await stream.changed.wait()
                stream.changed.clear()
                while sent < stream.due:
                    sent += 1
                    finish = engine_request.finish_reason if sent == total else None
                    text = "lorem" if sent == 1 else " lorem"
                    if chat:
                        delta: dict[str, str] = {"content": text}
                        if sent == 1:
                            delta = {"role": "assistant", **delta}
                        choice: dict[str, Any] = {"index": 0, "delta": delta}
                    else:
                        choice = {"index": 0, "text": text, "stop_reason": None}
                    choice.update(logprobs=None, finish_reason=finish)
                    await response.write(_sse({**head, "choices": [choice]}))
            if sent < total:
                error = {"message": "the server shut down before the request finished", "code": 503}
                await response.write(_sse({"error": {**error, "type": "ServiceUnavailableError"}}))
            elif include_usage:
                usage = {
                    "prompt_tokens": engine_request.prompt,
                    "completion_tokens": total,
                    "total_tokens": engine_request.prompt + total,
                }
                await response.write(_sse({**head, "choices": [], "usage": usage}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client went away; the engine finishes the request anyway
            pass
        finally:
            del self._streams[engine_request.id]
            self._wake.set()
        return response


def _sse(document: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(document, separators=(',', ':'))}\n\n".encode()


def _openai_error(message: str, status: int, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def text_tokens(text: str) -> int:
    """A tokenizer-free estimate: about four characters per token, at least one per word."""
    return max(1, len(text.split()), math.ceil(len(text) / 4))


def _count_prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        total = 0
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts
                content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
            total += text_tokens(str(content or "")) + 4  # role and separators
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
            return len(prompt)  # token ids
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return text_tokens(prompt[0])
        if len(prompt) == 1 and isinstance(prompt[0], list):
            return max(1, len(prompt[0]))
        raise ValueError("only one prompt per request is supported")
    raise ValueError("prompt must be a string or a list of token ids")


def run_emulator(settings: EmulatorSettings) -> int:
    """The process entry point: serve until drained."""

    async def main() -> int:
        server = EmulatorServer(settings)
        return await server.serve()

    return asyncio.run(main())


__all__ = ["EmulatorServer", "LoadSpec", "run_emulator", "text_tokens"]
