"""Small typed seams over the kubernetes client (its config and watch helpers are untyped)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


def api_client_for(kubeconfig: str | os.PathLike[str]) -> ApiClient:
    """A new ApiClient for a kubeconfig file (its current context)."""
    from kubernetes import config

    factory: Any = config.new_client_from_config
    return cast("ApiClient", factory(config_file=str(kubeconfig)))


def new_watch() -> Any:
    from kubernetes import watch

    factory: Any = watch.Watch
    return factory()
