"""All I/O: Prometheus, Kubernetes, the clock. They turn the outside world into plain values and back."""
