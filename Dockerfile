# syntax=docker/dockerfile:1
# The batchknee operator image. Two stages: build the wheels (batchknee's and its dependencies'), then
# install them into a fresh virtual environment on a slim Python runtime. Only the operator's own
# dependencies: the `plot` and `demo` extras (matplotlib, cryptography — the emulator's server, the
# local control plane, the demo) stay out of the image. The image runs as a numeric
# non-root user and needs nothing writable but /tmp (an emptyDir in the Helm chart), so it runs with a
# read-only root filesystem. tests/package repeats these steps (no Docker engine needed) and runs the
# result.
#
#   docker build -t batchknee:0.1.0 .
#   docker run --rm batchknee:0.1.0 --help
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY operator/ operator/
# Every wheel the runtime needs, batchknee's included (no extras), each dependency at the version
# constraints.txt pins (the set the tests passed with): the runtime stage installs from here only.
RUN python -m pip wheel --wheel-dir /wheels -c constraints.txt .

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="batchknee" \
      org.opencontainers.image.description="Kubernetes operator that keeps LLM engines' decode batch limit at the memory-bandwidth knee" \
      org.opencontainers.image.licenses="Apache-2.0"
# PYTHONDONTWRITEBYTECODE: the bytecode is compiled at install time; nothing is written next to it at
# run time. HOME and TMPDIR point at /tmp, the only writable path.
# The operator's /metrics and /healthz listen on all addresses in a container (they default to loopback).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/batchknee \
    PATH=/opt/batchknee/bin:$PATH \
    HOME=/tmp \
    TMPDIR=/tmp \
    BATCHKNEE_METRICS_ADDRESS=0.0.0.0 \
    BATCHKNEE_METRICS_PORT=8081 \
    BATCHKNEE_HEALTH_ADDRESS=0.0.0.0 \
    BATCHKNEE_HEALTH_PORT=8080
# A venv without pip (nothing to install at run time), filled by the base image's pip from the wheels.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m venv --without-pip /opt/batchknee \
 && python -m pip --python /opt/batchknee/bin/python install --no-index --find-links /wheels batchknee \
 && groupadd --system --gid 65532 batchknee \
 && useradd --system --uid 65532 --gid 65532 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin batchknee
USER 65532:65532
WORKDIR /tmp
# 8080: kopf's liveness endpoint /healthz; 8081: the operator's Prometheus /metrics.
EXPOSE 8080 8081
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('BATCHKNEE_HEALTH_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["batchknee"]
CMD ["operator"]
