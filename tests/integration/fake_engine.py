"""A stand-in engine the test kubelet runs as a pod's process.

Serves on --host/--port: /health (200), /metrics (Prometheus text), /args (what it was started with:
argv, selected env, cwd and the --config file's content). On SIGTERM it writes `sigterm` (the time, in
epoch seconds) into its working directory (the pod folder) and exits 0. Exits by itself after --max-lifetime seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

STARTED = time.time()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config")
    parser.add_argument("--exit-after", type=float, help="exit with status 3 after this many seconds")
    parser.add_argument("--max-lifetime", type=float, default=600)
    opts, _unknown = parser.parse_known_args()
    argv = sys.argv[1:]
    requests = {"n": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests["n"] += 1
            if self.path == "/health":
                self._send(200, "text/plain", b"ok\n")
            elif self.path == "/metrics":
                body = (
                    "# TYPE fake_engine_up gauge\nfake_engine_up 1\n"
                    f"# TYPE fake_engine_requests_total counter\nfake_engine_requests_total {requests['n']}\n"
                )
                self._send(200, "text/plain; version=0.0.4", body.encode())
            elif self.path == "/args":
                info: dict[str, Any] = {
                    "argv": argv,
                    "cwd": os.getcwd(),
                    "env": {
                        k: os.environ.get(k) for k in ("POD_IP", "POD_NAME", "POD_NAMESPACE", "FOO", "BAR")
                    },
                    "config": Path(opts.config).read_text() if opts.config else None,
                }
                self._send(200, "application/json", json.dumps(info).encode())
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((opts.host, opts.port), Handler)
    stop = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        Path("sigterm").write_text(f"{time.time():.6f}\n")  # when, on the wall clock
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    print(f"fake engine on {opts.host}:{opts.port} argv={argv}", flush=True)
    deadline = STARTED + (opts.exit_after if opts.exit_after is not None else opts.max_lifetime)
    while not stop.wait(0.1):
        if time.time() > deadline:
            server.shutdown()
            return 3 if opts.exit_after is not None else 0
    server.shutdown()
    print("fake engine: SIGTERM, exiting", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
