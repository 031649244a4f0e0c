"""A real local Kubernetes control plane and Prometheus for tests and the demo.

    from batchknee.devcluster import DevCluster, LocalPrometheus

    with DevCluster(runtimes={"vllm": [sys.executable, "-m", "batchknee.emulator", "vllm"]}) as cluster:
        cluster.kubectl("apply", "-f", "deploy.yaml")
        with LocalPrometheus(cluster.file_sd_path, scrape_interval_s=1) as prom:
            ...

The binaries come from `make tools` (see tools/); Prometheus from `make system-deps`.
"""

from batchknee.devcluster.cluster import DEFAULT_CONTROLLERS, DevCluster
from batchknee.devcluster.prometheus import LocalPrometheus
from batchknee.devcluster.tools import ToolsNotFoundError, tools_bin

__all__ = ["DEFAULT_CONTROLLERS", "DevCluster", "LocalPrometheus", "ToolsNotFoundError", "tools_bin"]
