"""SIGTERM under load, on a real `python -m batchknee emulate` process: drain, count, exit 0."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)


class Emulator:
    """A subprocess whose stderr lines are collected by a thread (so reads never block)."""

    def __init__(self, *argv: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "batchknee", "emulate", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        assert self.process.stderr is not None
        stream = self.process.stderr
        self.reader = threading.Thread(target=lambda: [self.lines.put(line) for line in stream], daemon=True)
        self.reader.start()

    def wait_for(self, pattern: str, timeout: float = 20.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                assert self.process.poll() is None, "\n".join(self.log)
                continue
            self.log.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} in:\n" + "".join(self.log))

    def terminate_and_wait(self, timeout: float = 60.0) -> tuple[int, dict[str, object]]:
        self.process.send_signal(signal.SIGTERM)
        try:
            # Not communicate(): it would read stderr too, racing the reader thread.
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        self.reader.join(timeout=10)  # every stderr line is in the queue
        assert self.process.stdout is not None
        out = self.process.stdout.read()  # one JSON line: no pipe can fill up
        summary = json.loads(out.strip().splitlines()[-1])
        return self.process.returncode, summary


@pytest.fixture
def started() -> Iterator[list[Emulator]]:
    """Every emulator a test starts; one a failed assertion left serving its open-loop load is killed."""
    emulators: list[Emulator] = []
    yield emulators
    for emulator in emulators:
        if emulator.process.poll() is None:
            emulator.process.kill()
            emulator.process.wait(timeout=10)


def start(started: list[Emulator], tmp_path: Path, *extra: str) -> tuple[Emulator, int]:
    emulator = Emulator(
        "--engine", "vllm", "--gpu", "a100-80gb", "serve", "meta-llama/Meta-Llama-3-8B", "--host", "127.0.0.1",
        "--port", "0", "--startup-delay-s", "0.1", "--speedup", "20", "--max-num-seqs", "32",
        "--summary-file", str(tmp_path / "summary.json"), *extra,
    )  # fmt: skip
    started.append(emulator)
    port = int(emulator.wait_for(r"listening on http://127\.0\.0\.1:(\d+)").group(1))
    emulator.wait_for(r"ready")
    return emulator, port


def in_flight(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    match = re.search(r"^batchknee_emulator_in_flight_requests\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match, text
    return float(match.group(1))


def test_sigterm_under_load_drops_nothing_when_the_grace_suffices(
    started: list[Emulator], tmp_path: Path
) -> None:
    emulator, port = start(
        started,
        tmp_path,
        "--request-rate",
        "20",
        "--prompt-tokens",
        "256",
        "--output-tokens",
        "200",
        "--drain-grace-s",
        "20",
    )
    time.sleep(1.0)
    assert in_flight(port) > 10
    answers: list[dict[str, object]] = []

    def complete() -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"prompt": "x " * 100, "max_tokens": 300}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answers.append(json.loads(response.read()))

    client = threading.Thread(target=complete)
    client.start()
    time.sleep(0.2)  # the completion is queued or running when SIGTERM comes
    status, summary = emulator.terminate_and_wait()
    client.join(timeout=30)
    log = "".join(emulator.log) + "".join(emulator.lines.queue)
    assert status == 0
    assert answers and answers[0]["usage"]["completion_tokens"] == 300  # type: ignore[index]
    assert summary["dropped"] == 0 and summary["rejected"] == 0
    assert summary["finished"] == summary["received"] > 100
    assert re.search(r"draining: (\d+) requests in flight", log)
    assert int(re.search(r"draining: (\d+) requests", log).group(1)) > 10  # type: ignore[union-attr]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_sigterm_reports_drops_when_the_grace_is_too_short(started: list[Emulator], tmp_path: Path) -> None:
    emulator, port = start(
        started,
        tmp_path,
        "--request-rate",
        "20",
        "--prompt-tokens",
        "256",
        "--output-tokens",
        "3000",
        "--drain-grace-s",
        "0.2",
    )
    time.sleep(0.8)
    waiting = in_flight(port)
    assert waiting > 10
    status, summary = emulator.terminate_and_wait()
    assert status == 0
    assert summary["dropped"] > 10
    assert summary["finished"] + summary["dropped"] + summary["rejected"] == summary["received"]
