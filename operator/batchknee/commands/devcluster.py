"""`batchknee dev-cluster up|exec`: a real local Kubernetes control plane in the foreground."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from batchknee.argtypes import at_most, non_negative_int
from batchknee.commands import UsageError, require_extra

PROMETHEUS_URL_ENV = "BATCHKNEE_PROMETHEUS_URL"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "dev-cluster",
        help="run a local Kubernetes control plane (etcd, kube-apiserver, controllers, test kubelet)",
        description="A throwaway local cluster on 127.0.0.1, built by `make tools`.",
    )
    sub = parser.add_subparsers(dest="dev_cluster_command", required=True, metavar="ACTION")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--with-prometheus",
            action="store_true",
            help="also run Prometheus on the kubelet's file_sd targets; "
            f"its URL goes in ${PROMETHEUS_URL_ENV}",
        )
        p.add_argument(
            "--runtime",
            action="append",
            default=[],
            metavar="NAME=COMMAND",
            help="run containers whose command[0] is NAME as the local COMMAND (shell-quoted argv prefix); "
            "repeatable, e.g. --runtime 'vllm=python -m batchknee.emulator vllm'",
        )
        p.add_argument(
            "--workdir", help="folder for certificates, etcd data and logs (default: a temp folder)"
        )
        p.add_argument(
            "--gpus",
            type=at_most(non_negative_int, 1024),
            default=8,
            help="nvidia.com/gpu capacity of the node (default 8)",
        )
        p.add_argument("--quiet", action="store_true", help="print only errors")

    up = sub.add_parser("up", help="start the cluster and wait for Ctrl-C")
    common(up)
    up.set_defaults(handler=run_up)

    exe = sub.add_parser(
        "exec",
        help="start the cluster, run a command against it, tear it down; exits with the command's status",
    )
    common(exe)
    exe.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    exe.set_defaults(handler=run_exec)


def _runtimes(specs: list[str]) -> dict[str, list[str]]:
    out = {}
    for spec in specs:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command.strip():
            raise UsageError(f"--runtime: wants NAME=COMMAND, got {spec!r}")
        out[name] = shlex.split(command)
    return out


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so the cluster is torn down in order."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[tuple[Any, dict[str, str]]]:
    require_extra("demo", "batchknee dev-cluster")
    from batchknee.devcluster import DevCluster, LocalPrometheus, ToolsNotFoundError

    try:
        cluster = DevCluster(runtimes=_runtimes(args.runtime), workdir=args.workdir, gpus=args.gpus)
    except ToolsNotFoundError as exc:
        raise SystemExit(f"batchknee dev-cluster: {exc}") from None
    _say(
        args, "dev-cluster: starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet …"
    )
    with cluster:
        _say(args, f"dev-cluster: ready in {cluster.start_seconds:.1f} s at {cluster.server}")
        env = cluster.env()
        if args.with_prometheus:
            try:
                prom = LocalPrometheus(cluster.file_sd_path, scrape_interval_s=1)
            except ToolsNotFoundError as exc:
                raise SystemExit(f"batchknee dev-cluster: {exc}") from None
            with prom:
                env[PROMETHEUS_URL_ENV] = prom.url
                _say(args, f"dev-cluster: prometheus at {prom.url}")
                yield cluster, env
        else:
            yield cluster, env


def run_up(args: argparse.Namespace) -> int:
    with _terminate_as_interrupt():
        try:
            with _cluster(args) as (cluster, env):
                lines = [
                    f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}",
                    f"export PATH={shlex.quote(str(cluster.tools_bin))}:$PATH",
                ]
                if PROMETHEUS_URL_ENV in env:
                    lines.append(f"export {PROMETHEUS_URL_ENV}={env[PROMETHEUS_URL_ENV]}")
                print("\n".join(lines), flush=True)
                _say(
                    args,
                    "dev-cluster: paste the lines above into another shell, then e.g. `kubectl get nodes`.\n"
                    f"dev-cluster: logs in {cluster.logs_dir}, pod folders in {cluster.pods_dir}.\n"
                    "dev-cluster: Ctrl-C stops everything.",
                )
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            _say(args, "dev-cluster: stopping")
    return 0


def run_exec(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("exec: give a command after --")
    status = 1
    with _terminate_as_interrupt():
        try:
            with _cluster(args) as (_cluster_obj, env):
                try:
                    # Same process group: Ctrl-C reaches the command too; we wait for it, then tear down.
                    proc = subprocess.Popen(cmd, env=env)
                except FileNotFoundError:
                    print(f"batchknee dev-cluster exec: {cmd[0]}: command not found", file=sys.stderr)
                    return 127
                try:
                    status = proc.wait()
                except KeyboardInterrupt:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGINT)
                    try:
                        status = proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        status = proc.wait()
        except KeyboardInterrupt:
            _say(args, "dev-cluster: interrupted")
            return 130
    return 128 - status if status < 0 else status
