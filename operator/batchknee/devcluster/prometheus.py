"""A real Prometheus (Debian's package) scraping the test kubelet's file_sd targets.

    with LocalPrometheus(cluster.file_sd_path, scrape_interval_s=1) as prom:
        prom.url                      # http://127.0.0.1:<free port>
        prom.stop(); prom.start()     # same URL and TSDB after a restart

Listens on a free loopback port with its own config and TSDB in a temporary folder, so it never meets
the packaged service (which the Debian package may start on :9090).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from batchknee.devcluster import procs, tools
from batchknee.devcluster.cluster import free_port


class LocalPrometheus:
    def __init__(
        self,
        file_sd_path: str | os.PathLike[str],
        scrape_interval_s: float = 1,
        workdir: str | os.PathLike[str] | None = None,
        *,
        job_name: str = "pods",
        extra_scrape_configs: Sequence[Mapping[str, Any]] = (),
        start_timeout_s: float = 60,
    ) -> None:
        self.file_sd_path = Path(file_sd_path).resolve()
        self.scrape_interval_s = scrape_interval_s
        self.job_name = job_name
        self.extra_scrape_configs = [dict(c) for c in extra_scrape_configs]
        self.start_timeout_s = start_timeout_s
        self.binary = tools.prometheus_binary()
        self._given_workdir = Path(workdir) if workdir is not None else None
        self.workdir = self._given_workdir or Path(tempfile.mkdtemp(prefix="batchknee-prometheus-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._spawner: procs.Spawner | None = None
        self._component: procs.Component | None = None
        self._write_config()

    @property
    def config_path(self) -> Path:
        return self.workdir / "prometheus.yml"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    @property
    def pid(self) -> int | None:
        return self._component.pid if self._component and self._component.alive() else None

    def _write_config(self) -> None:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        config = {
            "global": {
                "scrape_interval": interval,
                "evaluation_interval": interval,
                "scrape_timeout": interval,
            },
            "scrape_configs": [
                {
                    "job_name": self.job_name,
                    "file_sd_configs": [{"files": [str(self.file_sd_path)], "refresh_interval": "1s"}],
                },
                *self.extra_scrape_configs,
            ],
        }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    # -- lifecycle ----------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> Self:
        """Start (or restart) Prometheus on the same port and TSDB; returns once /-/ready answers."""
        if self._component is not None and self._component.alive():
            return self
        if self._spawner is None:
            self._spawner = procs.Spawner("prometheus-spawner")
        argv = [
            str(self.binary),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        with self.log_path.open("ab") as out:
            proc = self._spawner.popen(argv, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT)
        self._component = procs.Component("prometheus", proc, self.log_path, stop_grace_s=10)

        def ready() -> bool:
            comp = self._component
            if comp is None or not comp.alive():
                raise RuntimeError(f"prometheus exited; last lines of {self.log_path}:\n{self._tail()}")
            return self._get("/-/ready")[0] == 200

        procs.wait_until(ready, self.start_timeout_s, "prometheus /-/ready", on_timeout=self._tail)
        return self

    def stop(self) -> None:
        """Stop the process; keeps the port, config and TSDB for `start()`."""
        if self._component is not None:
            self._component.stop()
            self._component = None

    def close(self) -> None:
        """Stop and remove the temporary folder."""
        self.stop()
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None
        if self._given_workdir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return ""

    # -- small HTTP API helpers (tests) -------------------------------------------------------------

    def _get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException):
            return 0, b""
        finally:
            conn.close()

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; the `result` list (empty on error)."""
        status, body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        if status != 200:
            return []
        data = json.loads(body)
        result: list[dict[str, Any]] = data.get("data", {}).get("result", [])
        return result

    def targets(self) -> list[dict[str, Any]]:
        status, body = self._get("/api/v1/targets")
        if status != 200:
            return []
        active: list[dict[str, Any]] = json.loads(body).get("data", {}).get("activeTargets", [])
        return active

    def wait_for(self, promql: str, timeout_s: float = 30) -> list[dict[str, Any]]:
        """Poll until `promql` returns a non-empty result."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(promql)
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result for {promql!r} after {timeout_s:.0f} s")
            time.sleep(0.25)
