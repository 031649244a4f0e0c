"""The engines' runtime endpoints (`batchknee.ports.EngineRuntime`): live batch caps without a restart.

No released engine has one; two builds do (REFERENCE.md §2):
- vLLM PR #54816 (dev mode): `GET /v1/runtime_config` → `{"max_num_running_seqs": N,
  "max_num_seqs_capacity": C}`; `PATCH /v1/runtime_config {"max_num_running_seqs": N}`; N above the
  startup `--max-num-seqs` answers 400, an engine without it 501 (or 404: no such route).
- trimtab (patched vLLM/SGLang images): `GET /trimtab/knobs`, `POST /trimtab/set_knobs
  {"max_num_seqs": N}`.
Both register through vLLM's dev routers (`VLLM_SERVER_DEV_MODE=1`); without them a pod answers 404.
A pod is probed for the first, then the second. Every call has a short total deadline, answers
are read bounded, and nothing a pod says reaches status unsanitised.
"""

from __future__ import annotations

import json
import time
from typing import Any

import requests

from batchknee.ports import LiveCap, LiveCapError

RUNTIME_CONFIG = "/v1/runtime_config"
TRIMTAB_SET = "/trimtab/set_knobs"
TRIMTAB_KNOBS = "/trimtab/knobs"
UNSUPPORTED = (404, 405, 501)
MAX_ANSWER_BYTES = 64 * 1024


def _excerpt(text: str, limit: int = 200) -> str:
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class HttpEngineRuntime:
    def __init__(self, *, timeout_s: float = 2.0, session: requests.Session | None = None) -> None:
        self.timeout_s = timeout_s
        self.session = session or requests.Session()

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        deadline = time.monotonic() + self.timeout_s
        with self.session.request(
            method, url, json=body, timeout=(self.timeout_s, self.timeout_s), stream=True
        ) as response:
            data = b""
            for chunk in response.iter_content(8192):
                data += chunk
                if len(data) > MAX_ANSWER_BYTES or time.monotonic() > deadline:
                    raise LiveCapError(f"{method} {url}: answer too large or too slow")
        text = data.decode(errors="replace")
        try:
            return response.status_code, json.loads(text) if text.strip() else None
        except ValueError:
            return response.status_code, _excerpt(text)

    def read_cap(self, address: str) -> LiveCap | None:
        try:
            status, body = self._call("GET", f"http://{address}{RUNTIME_CONFIG}")
        except requests.RequestException as error:
            raise LiveCapError(f"GET {RUNTIME_CONFIG}: {type(error).__name__}") from None
        if status == 200 and isinstance(body, dict):
            cap, ceiling = body.get("max_num_running_seqs"), body.get("max_num_seqs_capacity")
            if not isinstance(cap, int) or isinstance(cap, bool):
                raise LiveCapError(f"GET {RUNTIME_CONFIG}: no integer max_num_running_seqs")
            return LiveCap("runtime-config", cap, ceiling if isinstance(ceiling, int) else None)
        if status not in UNSUPPORTED:
            raise LiveCapError(f"GET {RUNTIME_CONFIG} answered {status}: {_excerpt(str(body))}")
        try:
            status, body = self._call("GET", f"http://{address}{TRIMTAB_KNOBS}")
        except requests.RequestException as error:
            raise LiveCapError(f"GET {TRIMTAB_KNOBS}: {type(error).__name__}") from None
        if status in UNSUPPORTED:
            return None
        if status != 200 or not isinstance(body, dict):
            raise LiveCapError(f"GET {TRIMTAB_KNOBS} answered {status}: {_excerpt(str(body))}")
        cap = body.get("max_num_seqs")
        ceilings = body.get("ceilings")
        ceiling = ceilings.get("max_num_seqs") if isinstance(ceilings, dict) else None
        return LiveCap(
            "trimtab",
            cap if isinstance(cap, int) and not isinstance(cap, bool) else None,
            ceiling if isinstance(ceiling, int) and not isinstance(ceiling, bool) else None,
        )

    def set_cap(self, address: str, api: str, value: int) -> None:
        method, path, body = (
            ("PATCH", RUNTIME_CONFIG, {"max_num_running_seqs": value})
            if api == "runtime-config"
            else ("POST", TRIMTAB_SET, {"max_num_seqs": value})
        )
        try:
            status, answer = self._call(method, f"http://{address}{path}", body)
        except requests.RequestException as error:
            raise LiveCapError(f"{method} {path}: {type(error).__name__}") from None
        if status != 200:
            raise LiveCapError(f"{method} {path} {value} answered {status}: {_excerpt(str(answer))}")
