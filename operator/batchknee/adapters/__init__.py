"""All I/O: Prometheus (observation), Kubernetes (the engine objects, status, events)."""
