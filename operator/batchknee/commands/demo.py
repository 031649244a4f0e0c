"""`batchknee demo`: the closed loop on an embedded local cluster, as traffic shifts."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the closed loop on a local cluster: traffic shifts and the operator retunes the engines",
        description="Start a local control plane whose test kubelet runs `batchknee emulate` for engine pods, "
        "a real Prometheus and the operator; apply the demo's LLMServing (Llama-3-8B on A100-80GB, "
        "two replicas, demo timings), a Recommend-mode twin and a Live twin (caps set through the engine's "
        "runtime endpoint, no restart); drive traffic at 512, 2,048 and 8,192 tokens of context; print a live "
        "timeline and, per phase, Restart and Live side by side (reaction time, pods restarted, requests "
        "failed); write timeline.json, timeline.png and comparison.txt; tear everything down.",
    )
    parser.add_argument("--fast", action="store_true", help="short phases (the e2e test's scenario)")
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="where the timeline goes")
    parser.add_argument("--gpu", default="a100-80gb", help="the GPU the emulated engines pretend to be")
    parser.set_defaults(handler=run)


def check_before_starting(args: argparse.Namespace) -> None:
    """What would fail only once the cluster is up (the emulated engines' GPU) or halfway through
    starting it (a missing binary): refused before anything starts or is written."""
    from batchknee.commands import UsageError
    from batchknee.core.catalog import CatalogError, find_gpu
    from batchknee.devcluster.tools import ToolsNotFoundError, prometheus_binary, tools_bin

    try:
        find_gpu(args.gpu)
    except CatalogError as error:
        raise UsageError(f"--gpu: {error.args[0]}") from None
    out = args.out
    if out.exists() and not out.is_dir():  # it was found only after the cluster had started
        raise UsageError(f"--out: {out} is a file, not a folder; give a folder for the timeline")
    if not out.exists() and not out.parent.is_dir():
        raise UsageError(f"--out: folder {out.parent} does not exist; create it or give another folder")
    try:
        tools_bin()
        prometheus_binary()
    except ToolsNotFoundError as error:
        raise UsageError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    from batchknee.commands import require_extra

    require_extra("demo", "batchknee demo")
    check_before_starting(args)
    from batchknee.devcluster import netns

    # Like a real node: pods on their own addresses in a network namespace this run creates, so the
    # engine Service has endpoints; where none can be made it says why and goes on with loopback.
    again = ["demo", *(["--fast"] if args.fast else []), "--out", str(args.out), "--gpu", args.gpu]
    netns.exec_inside([sys.executable, "-m", "batchknee", *again])
    from batchknee.demo.run import default_examples, run_scenario
    from batchknee.demo.scenario import FAST, FULL
    from batchknee.demo.world import DemoWorld

    scenario = FAST if args.fast else FULL
    print(
        f"batchknee demo ({scenario.name}): {len(scenario.phases)} phases, {scenario.duration_s:.0f} s of traffic, "
        f"emulators at {scenario.speedup:g}× real time; output in {args.out}/",
        flush=True,
    )
    with DemoWorld(args.out, gpu=args.gpu, speedup=scenario.speedup, examples=default_examples()) as world:
        print(
            f"cluster up: KUBECONFIG={world.cluster.kubeconfig}  Prometheus {world.prometheus.url}",
            flush=True,
        )
        if netns.private():
            print(
                f"  (in this run's network namespace: nsenter --net=/proc/{os.getpid()}/ns/net kubectl …)",
                flush=True,
            )
        run_scenario(world, scenario, sys.stdout)
    print(
        f"\nwrote {args.out / 'timeline.json'}, {args.out / 'timeline.png'} and {args.out / 'comparison.txt'}; "
        "everything is torn down"
    )
    return 0
