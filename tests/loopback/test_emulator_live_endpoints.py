"""The emulator's live-cap endpoints (vLLM PR #54816's /v1/runtime_config, trimtab's
/trimtab/set_knobs) served in-process on 127.0.0.1, their flags, and the fault flags."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
import pytest

from batchknee.emulator.engine import Engine
from batchknee.emulator.engine_args import EngineArgsError, parse_emulator_args
from batchknee.emulator.server import EmulatorServer

pytestmark = pytest.mark.timeout(60)

BASE = [
    "--engine",
    "vllm",
    "--gpu",
    "a100-80gb",
    "--host",
    "127.0.0.1",
    "--port",
    "0",
    "--startup-delay-s",
    "0.05",
]
POD_ARGS = ["serve", "meta-llama/Meta-Llama-3-8B", "--max-num-seqs", "64", "--served-model-name", "llama"]


@contextlib.asynccontextmanager
async def emulator(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> AsyncIterator[tuple[EmulatorServer, aiohttp.ClientSession]]:
    settings = parse_emulator_args([*BASE, *argv], environ=dict(environ or {}))
    server = EmulatorServer(settings, log=io.StringIO(), out=io.StringIO())
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 10
    while server.port is None or not server.ready:
        assert time.monotonic() < deadline, "the emulator did not start"
        assert not task.done(), task.result()
        await asyncio.sleep(0.01)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as session:
            yield server, session
    finally:
        server.settings = dataclasses.replace(settings, drain_grace_s=0.0)
        server.begin_drain()
        await asyncio.wait_for(task, 20)


async def call(session: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with session.request(method, path, json=body) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


def test_runtime_config_round_trip_and_its_bounds() -> None:
    async def check() -> None:
        async with emulator([*POD_ARGS, "--emulator-runtime-config"]) as (server, session):
            assert await call(session, "GET", "/v1/runtime_config") == (
                200,
                {"max_num_running_seqs": 64, "max_num_seqs_capacity": 64},
            )
            status, body = await call(session, "PATCH", "/v1/runtime_config", {"max_num_running_seqs": 16})
            assert (status, body) == (200, {"max_num_running_seqs": 16, "max_num_seqs_capacity": 64})
            assert server.engine.live_max_num_seqs == 16

            status, body = await call(session, "PATCH", "/v1/runtime_config", {"max_num_running_seqs": 65})
            assert status == 400
            assert "--max-num-seqs (64)" in body["error"]["message"]
            for bad in ({"max_num_running_seqs": 0}, {"max_num_running_seqs": "8"}, {"max_num_running_seqs": 2.5},
                        {"max_num_running_seqs": True}, {}, {"max_num_running_seqs": 8, "max_num_seqs": 8}, [8]):  # fmt: skip
                status, body = await call(session, "PATCH", "/v1/runtime_config", bad)
                assert status == 400, bad
                assert body["error"]["code"] == 400 and body["error"]["message"], bad
            async with session.patch("/v1/runtime_config", data=b"{not json") as response:
                assert response.status == 400
            # Refused changes leave the cap where it was.
            assert (await call(session, "GET", "/v1/runtime_config"))[1]["max_num_running_seqs"] == 16
            # Only the endpoint the build has: trimtab's is absent.
            assert (await call(session, "POST", "/trimtab/set_knobs", {"max_num_seqs": 8}))[0] == 404

    asyncio.run(check())


def test_trimtab_set_knobs_and_knobs() -> None:
    async def check() -> None:
        env = {"BATCHKNEE_EMULATOR_LIVE_ENDPOINTS": "trimtab"}  # per pod, as an image choice would be
        async with emulator(POD_ARGS, environ=env) as (server, session):
            status, body = await call(session, "POST", "/trimtab/set_knobs", {"max_num_seqs": 8})
            assert (status, body) == (200, {"ok": True, "applied": {"max_num_seqs": 8}, "rejected": {}})
            status, knobs = await call(session, "GET", "/trimtab/knobs")
            assert status == 200
            assert knobs["max_num_seqs"] == 8 and knobs["ceilings"]["max_num_seqs"] == 64
            assert knobs["max_num_seqs_effective"] == 8 and knobs["running"] == 0

            status, body = await call(session, "POST", "/trimtab/set_knobs", {"max_num_seqs": 65})
            assert status == 400 and body["ok"] is False and body["applied"] == {}
            assert "1..64" in body["rejected"]["max_num_seqs"]
            status, body = await call(session, "POST", "/trimtab/set_knobs", {"max_num_batched_tokens": 512})
            assert status == 400 and set(body["rejected"]) == {"max_num_batched_tokens"}
            assert (await call(session, "POST", "/trimtab/set_knobs", [1]))[0] == 400
            assert server.engine.live_max_num_seqs == 8
            assert (await call(session, "GET", "/v1/runtime_config"))[0] == 404

    asyncio.run(check())


@pytest.mark.parametrize("engine_args", [POD_ARGS, ["--engine", "trtllm", "llama-3-8b", "--emulator-runtime-config",
                                                    "--emulator-trimtab"]])  # fmt: skip
def test_without_support_the_live_endpoints_answer_404(engine_args: list[str]) -> None:
    async def check() -> None:
        async with emulator(engine_args) as (server, session):
            for method, path, body in (("GET", "/v1/runtime_config", None),
                                       ("PATCH", "/v1/runtime_config", {"max_num_running_seqs": 8}),
                                       ("POST", "/trimtab/set_knobs", {"max_num_seqs": 8}),
                                       ("GET", "/trimtab/knobs", None)):  # fmt: skip
                assert (await call(session, method, path, body))[0] == 404, path
            assert server.engine.live_max_num_seqs == server.settings.config.max_num_seqs

    asyncio.run(check())


def test_a_request_stream_keeps_succeeding_across_a_lowered_and_raised_cap() -> None:
    statuses: list[int] = []
    running_seen: list[tuple[int, int]] = []

    def checked(engine: Engine, duration: float, tokens: int, decoding: int) -> None:
        engine.check_invariants()  # running above the live cap only while draining down to it
        running_seen.append((engine.live_max_num_seqs, engine.num_running))

    async def client(session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        for _ in range(200):
            if stop.is_set():
                return
            body = {"model": "llama", "prompt": "hello " * 64, "max_tokens": 120}
            async with session.post("/v1/completions", json=body) as response:
                statuses.append(response.status)
                await response.read()

    async def check() -> None:
        argv = [*POD_ARGS, "--emulator-runtime-config", "--emulator-trimtab", "--speedup", "20"]
        async with emulator(argv) as (server, session):
            server.engine.step_hook = checked
            stop = asyncio.Event()
            clients = [asyncio.create_task(client(session, stop)) for _ in range(48)]
            deadline = time.monotonic() + 10
            while server.engine.num_running < 40:
                assert time.monotonic() < deadline, "the batch did not fill"
                await asyncio.sleep(0.02)
            lowered = len(running_seen)
            assert (await call(session, "PATCH", "/v1/runtime_config", {"max_num_running_seqs": 16}))[
                0
            ] == 200
            deadline = time.monotonic() + 10
            while (await call(session, "GET", "/trimtab/knobs"))[1]["running"] > 16:
                assert time.monotonic() < deadline, "the batch did not drain to the lowered cap"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            assert (
                max(running for cap, running in running_seen[lowered:] if cap == 16) > 16
            )  # drained, not cut
            raised = len(running_seen)
            assert (await call(session, "POST", "/trimtab/set_knobs", {"max_num_seqs": 32}))[0] == 200
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 20)
        assert max(running for _, running in running_seen[raised:]) == 32
        assert statuses and set(statuses) == {200}
        stats = server.engine.stats
        assert stats.dropped == 0 and stats.rejected == 0 and stats.finished == len(statuses)

    asyncio.run(check())


def test_the_kubelet_line_carries_the_emulator_switches_and_the_fault() -> None:
    argv = [*BASE, *POD_ARGS, "--trust-remote-code", "--emulator-runtime-config", "--emulator-trimtab",
            "--fault-step-slowdown", "3", "--fault-above-running", "48", "--host", "127.1.0.3"]  # fmt: skip
    settings = parse_emulator_args(argv, environ={})
    assert settings.runtime_config_endpoint and settings.trimtab_endpoint
    assert (settings.config.fault_step_slowdown, settings.config.fault_above_running) == (3.0, 48)
    assert settings.ignored == ("--trust-remote-code",)
    plain = parse_emulator_args([*BASE, *POD_ARGS], environ={})
    assert not plain.runtime_config_endpoint and not plain.trimtab_endpoint
    assert plain.config.fault_above_running is None


@pytest.mark.parametrize(
    ("extra", "environ", "message"),
    [
        (["--fault-step-slowdown", "3"], {}, "go together"),
        (["--fault-above-running", "8"], {}, "go together"),
        (["--fault-step-slowdown", "0", "--fault-above-running", "8"], {}, "--fault-step-slowdown"),
        (["--fault-step-slowdown", "2", "--fault-above-running", "-1"], {}, "--fault-above-running"),
        ([], {"BATCHKNEE_EMULATOR_LIVE_ENDPOINTS": "runtime-config,sleep"}, "sleep is not one of"),
    ],
)
def test_bad_live_and_fault_settings_name_the_option(
    extra: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(EngineArgsError, match=message):
        parse_emulator_args([*BASE, *POD_ARGS, *extra], environ=environ)
