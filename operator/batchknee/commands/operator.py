"""`batchknee operator`: run the operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any

from batchknee.commands import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the operator: keep every LLMServing's engines at the knee",
        description="Run the batchknee operator against the cluster of the current kubeconfig (or in-cluster "
        "service account). Every option also reads from the environment (BATCHKNEE_*); flags win.",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch this namespace (repeatable; default: BATCHKNEE_NAMESPACES, else the whole cluster)",
    )
    parser.add_argument("--prometheus-url", help="Prometheus base URL (BATCHKNEE_PROMETHEUS_URL)")
    parser.add_argument(
        "--metrics-address", help="address of the operator's /metrics (BATCHKNEE_METRICS_ADDRESS)"
    )
    parser.add_argument(
        "--metrics-port", type=int, help="port of /metrics, 0 for none (BATCHKNEE_METRICS_PORT)"
    )
    parser.add_argument("--health-address", help="address of /healthz (BATCHKNEE_HEALTH_ADDRESS)")
    parser.add_argument(
        "--health-port", type=int, help="port of /healthz, 0 for none (BATCHKNEE_HEALTH_PORT)"
    )
    parser.add_argument(
        "--peering",
        choices=("auto", "mandatory", "standalone"),
        help="kopf peering between replicas (BATCHKNEE_PEERING; default auto)",
    )
    parser.add_argument("--peering-name", help="the peering object's name (BATCHKNEE_PEERING_NAME)")
    parser.add_argument("--priority", type=int, help="this replica's peering priority (default: random)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.set_defaults(handler=run)


def settings_from(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from batchknee.settings import OperatorSettings

    overrides = {
        "namespaces": args.namespaces,
        "prometheus_url": args.prometheus_url,
        "metrics_address": args.metrics_address,
        "metrics_port": args.metrics_port,
        "health_address": args.health_address,
        "health_port": args.health_port,
        "peering": args.peering,
        "peering_name": args.peering_name,
        "peering_priority": args.priority,
        "verbose": args.verbose or None,
    }
    given = {field: value for field, value in overrides.items() if value is not None}
    try:
        return OperatorSettings(**given)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        field = ".".join(str(part) for part in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        if field in given:  # the flag's value, which wins over the variable
            raise UsageError(f"{FLAGS.get(field, field)}: {message} ({field})") from None
        raise UsageError(f"{field}: {message} (BATCHKNEE_{field.upper()})") from None


# The settings the flags above set, by the flag's name (--priority is peering_priority's).
FLAGS = {
    "namespaces": "--namespace",
    "prometheus_url": "--prometheus-url",
    "metrics_address": "--metrics-address",
    "metrics_port": "--metrics-port",
    "health_address": "--health-address",
    "health_port": "--health-port",
    "peering": "--peering",
    "peering_name": "--peering-name",
    "peering_priority": "--priority",
    "verbose": "--verbose",
}


def warn_of_unknown_variables(environ: Mapping[str, str]) -> None:
    """One warning per BATCHKNEE_* variable that nothing reads (a misspelt setting would otherwise
    leave its default in force unseen). Not an error: it may be meant for something else."""
    from batchknee.settings import unknown_variables

    for name, close in unknown_variables(environ):
        hint = f"; did you mean {close}?" if close else ""
        # the name only, never the value: it may be a secret
        logging.getLogger("batchknee").warning(
            "environment variable %s is not an operator setting and is ignored%s", name, hint
        )


def check_cluster_config() -> None:
    """Neither a pod's service account nor a kubeconfig: say so, and how to give one."""
    from kubernetes.config import ConfigException

    from batchknee.adapters.kubernetes import load_config

    try:
        load_config()
    except ConfigException as error:
        raise UsageError(
            f"no cluster configuration found ({error}): set KUBECONFIG to a kubeconfig file (or write "
            "~/.kube/config), or run the operator in a pod with a service account"
        ) from None
    except Exception as error:  # a malformed kubeconfig: YAML errors, wrong shapes
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"the kubeconfig does not load ({first}); check the file KUBECONFIG names") from None


def run(args: argparse.Namespace) -> int:
    from batchknee import logs

    settings = settings_from(args)
    logs.configure(settings.verbose)  # for the warnings below; handlers.run's own call adds nothing
    warn_of_unknown_variables(os.environ)
    check_cluster_config()
    from batchknee.handlers import run as run_operator

    return run_operator(settings)
