"""A private network namespace for the local world, so pods get addresses a Service can route to.

The apiserver refuses loopback addresses in EndpointSlices, so on 127.x pod IPs a Service has no
endpoints. Inside a network namespace that the run creates itself (`unshare --net`, or with a user
namespace `unshare --user --map-root-user --net` where the process is not root), `lo` is brought up
and 10.0.0.0/8 is routed locally on it: every 10.x.y.z address is this namespace's own, pods bind
them, the controller-manager's EndpointSlice controller publishes them, and no packet can leave the
namespace (it has no other interface). Everything else stays on the namespace's 127.0.0.1.

    python -m batchknee.devcluster.in_netns CMD [ARG...]

runs CMD inside a fresh namespace when the machine allows one, else runs it as it is and says why
(pods then get loopback addresses and clients address Ready pods directly). `$BATCHKNEE_POD_NETNS`
tells the world which namespace is the run's own: the kubelet hands out 10.x addresses only there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

ENV = "BATCHKNEE_POD_NETNS"  # the namespace id the run created; "off" disables the namespace
POD_ROUTE = "10.0.0.0/8"  # routed locally on lo inside the namespace only
PROBE_TIMEOUT_S = 20


def namespace_id() -> str:
    """This process's network namespace, as the kernel names it (`net:[4026531840]`)."""
    return os.readlink("/proc/self/ns/net")


def private() -> bool:
    """True inside the network namespace this run created (where 10.x addresses are our own)."""
    try:
        return os.environ.get(ENV) == namespace_id()
    except OSError:
        return False


def _unshare_argv() -> list[str] | None:
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    if os.geteuid() == 0:
        return [unshare, "--net"]
    return [unshare, "--user", "--map-root-user", "--net"]


def _inside_argv(command: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "batchknee.devcluster.in_netns", "--inside", *command]


def unavailable() -> str | None:
    """Why no private namespace can be made here, or None when one can (tried once, throwaway)."""
    if os.environ.get(ENV) == "off":
        return f"${ENV}=off"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    unshare = _unshare_argv()
    if unshare is None:
        return "no `unshare` (util-linux)"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2; `make system-deps` installs it)"
    try:
        probe = subprocess.run(
            [*unshare, *_inside_argv(["true"])], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`unshare` failed: {exc}"
    if probe.returncode != 0:
        lines = (probe.stderr or probe.stdout).strip().splitlines()
        return f"`{' '.join(unshare)}` failed: {lines[-1] if lines else f'exit {probe.returncode}'}"
    return None


def exec_inside(command: Sequence[str]) -> None:
    """Replace this process with `command` inside a fresh private namespace; return only when none
    can be made (after saying why on stderr), so the caller goes on without one."""
    if private():
        return
    why = unavailable()
    if why is not None:
        print(
            f"pod network: loopback addresses, no private network namespace ({why}); Services get no "
            "endpoints, so clients address the Ready pods directly",
            file=sys.stderr,
            flush=True,
        )
        return
    unshare = _unshare_argv()
    assert unshare is not None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(unshare[0], [*unshare, *_inside_argv(command)])


def set_up_and_exec(command: Sequence[str]) -> None:
    """In the fresh namespace: lo up, 10.0.0.0/8 local on it, mark it ours, exec the command."""
    for step in (["link", "set", "lo", "up"], ["route", "add", "local", POD_ROUTE, "dev", "lo"]):
        subprocess.run(["ip", *step], check=True)
    os.environ[ENV] = namespace_id()
    if command[0] != "true":
        print(
            f"pod network: a private network namespace ({os.environ[ENV]}), pods on {POD_ROUTE} inside it",
            file=sys.stderr,
            flush=True,
        )
    os.execvp(command[0], list(command))
