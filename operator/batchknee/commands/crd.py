"""`batchknee crd`: the LLMServing CustomResourceDefinition, generated from the API models."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "crd",
        help="print the LLMServing CRD (YAML) generated from the API models",
        description="Print the batchknee.io/v1alpha1 LLMServing CustomResourceDefinition. "
        "`make crds` writes it to crds/.",
    )
    parser.add_argument(
        "--peering",
        action="store_true",
        help="print kopf's peering CRDs instead (KopfPeering, ClusterKopfPeering) for running several replicas",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchknee.api.crd import crd_yaml, peering_crd_yaml

    print(peering_crd_yaml() if args.peering else crd_yaml(), end="")
    return 0
