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
    which = parser.add_mutually_exclusive_group()  # one document each: the other was silently dropped
    which.add_argument(
        "--peering",
        action="store_true",
        help="print kopf's peering CRDs instead (KopfPeering, ClusterKopfPeering) for running several replicas",
    )
    which.add_argument(
        "--requester-policy",
        action="store_true",
        help="print the ValidatingAdmissionPolicy that makes writers of admin-gated LLMServing fields prove "
        "they could create such a pod themselves",
    )
    parser.add_argument(
        "--chart",
        action="store_true",
        help="print it as the Helm chart's template (charts/batchknee/templates/crds/; gated by crds.enabled)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from batchknee.api.crd import (
        chart_crd_template,
        chart_peering_crd_template,
        chart_requester_policy_template,
        crd_yaml,
        peering_crd_yaml,
        requester_policy_yaml,
    )

    if args.requester_policy:
        print(chart_requester_policy_template() if args.chart else requester_policy_yaml(), end="")
    elif args.chart:
        print(chart_peering_crd_template() if args.peering else chart_crd_template(), end="")
    else:
        print(peering_crd_yaml() if args.peering else crd_yaml(), end="")
    return 0
