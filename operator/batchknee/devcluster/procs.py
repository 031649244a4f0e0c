"""Child processes that cannot outlive their parent.

Each child runs in its own session (its own process group, so a terminal's Ctrl-C reaches only the
harness, which then tears down in order) and has PR_SET_PDEATHSIG=SIGKILL, so it dies if the
harness is SIGKILLed. Linux delivers that signal when the *thread* that forked the child exits, not
the process, so all forks go through one long-lived thread per `Spawner`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec: no locks, no imports
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


class Spawner:
    """Starts child processes from one dedicated thread that lives until `close()`.

    Close only after the children are gone: closing ends the thread, which SIGKILLs any left.
    """

    def __init__(self, name: str = "spawner") -> None:
        self._requests: queue.Queue[tuple[Callable[[], subprocess.Popen[bytes]], Future[Any]] | None] = (
            queue.Queue()
        )
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            start, result = item
            try:
                result.set_result(start())
            except BaseException as exc:  # handed back to the caller
                result.set_exception(exc)

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        stdout: IO[bytes] | int | None = None,
        stderr: IO[bytes] | int | None = None,
    ) -> subprocess.Popen[bytes]:
        if not self._thread.is_alive():
            raise RuntimeError("spawner is closed")
        parent = os.getpid()

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                list(argv),
                env=dict(env) if env is not None else None,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                preexec_fn=_die_with_parent(parent),
                close_fds=True,
            )

        done: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((start, done))
        return done.result(timeout=60)

    def close(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=10)


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by `pid` (our children lead their own sessions)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM the child's group, wait up to `grace_s`, then SIGKILL it; returns the exit status."""
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(grace_s, 0.0))
    # Kill stragglers in the group even when the leader already exited.
    signal_group(proc.pid, signal.SIGKILL)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return None


@dataclass
class Component:
    """A long-running child (etcd, kube-apiserver …) with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stop_grace_s: float = 10.0
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        status = stop_process(self.proc, self.stop_grace_s)
        if self._log is not None:
            self._log.close()
        return status

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def start_component(
    spawner: Spawner,
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stop_grace_s: float = 10.0,
) -> Component:
    log_path = log_dir / f"{name}.log"
    log = log_path.open("ab")
    proc = spawner.popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    return Component(name, proc, log_path, stop_grace_s, log)


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    on_timeout: Callable[[], str] | None = None,
) -> None:
    """Poll `predicate` until true, at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            detail = on_timeout() if on_timeout else ""
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{detail}".rstrip())
        time.sleep(interval_s)
