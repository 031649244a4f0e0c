"""The engines' runtime endpoints (`batchknee.ports.EngineRuntime`): live batch caps without a restart.

No released engine has one; two builds do (REFERENCE.md §2):
- vLLM PR #54816 (dev mode): `GET /v1/runtime_config` → `{"max_num_running_seqs": N,
  "max_num_seqs_capacity": C}`; `PATCH /v1/runtime_config {"max_num_running_seqs": N}`; N above the
  startup `--max-num-seqs` answers 400, an engine without it 501 (or 404: no such route).
- trimtab (patched vLLM/SGLang images): `GET /trimtab/knobs`, `POST /trimtab/set_knobs
  {"max_num_seqs": N}`.
Both register through vLLM's dev routers (`VLLM_SERVER_DEV_MODE=1`); without them a pod answers 404.
A pod is probed for the first, then the second. Every call has a short total deadline (each read
of the answer, its status line and headers included, is given only the time left, so a pod that
trickles bytes cannot stretch it), answers are read bounded, a redirect is an error and never
followed (the pod, which may run its tenant's code, would choose where the operator calls next),
and nothing a pod says reaches status unsanitised. A pod that did not answer in
time, or answered only after half the deadline or more, is not called again for a backoff, 30 s
doubling to 5 minutes while it stays so: a tenant's wedged or slow pods cost one deadline per
backoff, not one per evaluation, of the Live workers every tenant shares. A quick refusal costs
nothing and is not held against the pod; a slow redirect is held like any slow answer; the count
stands until the pod has not been slow for 5 minutes (a quick answer to one call does not undo what
a slow one earned: a pod quick to read and slow to set would cost a deadline every evaluation).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchknee.adapters.deadline_http import ResponseBefore, head_too_large, reads_before
from batchknee.ports import LiveCap, LiveCapError

RUNTIME_CONFIG = "/v1/runtime_config"
TRIMTAB_SET = "/trimtab/set_knobs"
TRIMTAB_KNOBS = "/trimtab/knobs"
UNSUPPORTED = (404, 405, 501)
MAX_ANSWER_BYTES = 64 * 1024
SILENT_BACKOFF_S = 30.0  # one evaluation interval of the demo's; doubled per silent probe after it
MAX_SILENT_BACKOFF_S = 300.0
SILENT_SHARE = 0.5  # of the deadline: a failure that took this long cost a worker that long


def _exchange(
    address: str, method: str, path: str, body: dict[str, Any] | None, deadline: float
) -> tuple[int, bytes]:
    """One HTTP exchange with a pod, over before `deadline`; the answer's body up to MAX_ANSWER_BYTES."""
    connection = http.client.HTTPConnection(address, timeout=max(deadline - time.monotonic(), 0.001))
    connection.response_class = ResponseBefore
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        data = response.read(MAX_ANSWER_BYTES + 1)
        if len(data) > MAX_ANSWER_BYTES:
            raise LiveCapError(f"{method} {path}: answered more than {MAX_ANSWER_BYTES // 1024} KiB")
        return response.status, data
    finally:
        connection.close()


def _excerpt(text: str, limit: int = 200) -> str:
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@dataclass(frozen=True)
class _Silence:
    """A pod that did not answer in time: how many times running, and until when it is not called."""

    times: int
    until: float
    answered: bool = False  # the last call did answer, in time but slowly


def _failure(error: Exception) -> str:
    """What went wrong, in words a status can carry (never the pod's text)."""
    if isinstance(error, TimeoutError):
        return f"no answer within the deadline ({type(error).__name__})"
    if head_too_large(error):
        return str(error)
    return type(error).__name__


def _running(times: int) -> str:
    return "" if times == 1 else f" ({times} times running)"


def _slow(silence: _Silence, timeout_s: float) -> str:
    if silence.answered:
        return f"took half its {timeout_s:g}-s deadline or more to answer"
    return f"did not answer within {timeout_s:g} s"


def _forgotten(silence: _Silence, now: float) -> bool:
    """Its backoff ended the longest backoff ago: a pod slow again since starts its count anew."""
    return silence.until < now - MAX_SILENT_BACKOFF_S


def _backoff_s(times: int) -> float:
    return min(MAX_SILENT_BACKOFF_S, SILENT_BACKOFF_S * 2.0 ** (times - 1))


def _ceiling(value: Any) -> int | None:
    """A reported startup limit: a count of one or more, else not reported (`true` is no count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


class HttpEngineRuntime:
    def __init__(self, *, timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock  # the backoff's; the deadline of a call is time.monotonic()'s
        self._silent: dict[str, _Silence] = {}  # by pod address
        self._lock = threading.Lock()  # the reconciles' threads call pods at once

    def _call(
        self, method: str, address: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        started = self.clock()
        with self._lock:
            silence = self._silent.get(address)
        if silence is not None and started < silence.until:
            raise LiveCapError(
                f"{_slow(silence, self.timeout_s)}{_running(silence.times)}: "
                f"not called again for {_backoff_s(silence.times):.0f} s"
            )
        try:
            deadline = time.monotonic() + self.timeout_s
            with reads_before(deadline):
                status, data = _exchange(address, method, path, body, deadline)
        except (OSError, http.client.HTTPException) as error:
            self._fell_silent(address, silence, started)
            raise LiveCapError(f"{method} {path}: {_failure(error)}") from None
        except LiveCapError:
            self._fell_silent(address, silence, started)
            raise
        if self.clock() - started >= SILENT_SHARE * self.timeout_s:  # in time, but it cost as much
            self._fell_silent(address, silence, started, answered=True)
        elif silence is not None and _forgotten(silence, self.clock()):
            with self._lock:
                self._silent.pop(address, None)
        if 300 <= status < 400:
            raise LiveCapError(f"{method} {path} answered {status}: a redirect, not followed")
        text = data.decode(errors="replace")
        try:
            return status, json.loads(text) if text.strip() else None
        except (ValueError, RecursionError):  # not JSON, or JSON nested past the interpreter's limit
            return status, _excerpt(text)

    def _fell_silent(
        self, address: str, before: _Silence | None, started: float, *, answered: bool = False
    ) -> None:
        """Hold a call that took half the deadline or more against the pod, failed or answered (a
        quick refusal cost nothing); the count goes on until the pod has not been slow for the
        longest backoff (a quick answer on one endpoint would otherwise reset what a slow one on
        another earned, and its pod would cost a deadline at every evaluation); forget pods not slow
        for that long (gone, most likely)."""
        now = self.clock()
        if now - started < SILENT_SHARE * self.timeout_s:
            return
        times = before.times + 1 if before is not None and not _forgotten(before, now) else 1
        with self._lock:
            for stale in [a for a, s in self._silent.items() if _forgotten(s, now)]:
                del self._silent[stale]
            self._silent[address] = _Silence(times, now + _backoff_s(times), answered)

    def read_cap(self, address: str) -> LiveCap | None:
        status, body = self._call("GET", address, RUNTIME_CONFIG)
        if status == 200 and isinstance(body, dict):
            cap, ceiling = body.get("max_num_running_seqs"), body.get("max_num_seqs_capacity")
            if not isinstance(cap, int) or isinstance(cap, bool):
                raise LiveCapError(f"GET {RUNTIME_CONFIG}: no integer max_num_running_seqs")
            return LiveCap("runtime-config", cap, _ceiling(ceiling))
        if status not in UNSUPPORTED:
            raise LiveCapError(f"GET {RUNTIME_CONFIG} answered {status}: {_excerpt(str(body))}")
        status, body = self._call("GET", address, TRIMTAB_KNOBS)
        if status in UNSUPPORTED:
            return None
        if status != 200 or not isinstance(body, dict):
            raise LiveCapError(f"GET {TRIMTAB_KNOBS} answered {status}: {_excerpt(str(body))}")
        cap = body.get("max_num_seqs")
        ceilings = body.get("ceilings")
        ceiling = ceilings.get("max_num_seqs") if isinstance(ceilings, dict) else None
        return LiveCap(
            "trimtab", cap if isinstance(cap, int) and not isinstance(cap, bool) else None, _ceiling(ceiling)
        )

    def set_cap(self, address: str, api: str, value: int) -> None:
        method, path, body = (
            ("PATCH", RUNTIME_CONFIG, {"max_num_running_seqs": value})
            if api == "runtime-config"
            else ("POST", TRIMTAB_SET, {"max_num_seqs": value})
        )
        status, answer = self._call(method, address, path, body)
        if status != 200:
            raise LiveCapError(f"{method} {path} {value} answered {status}: {_excerpt(str(answer))}")
