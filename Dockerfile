# syntax=docker/dockerfile:1
# Every Tandem service's image, from this one file: SERVICE names the folder under
# services/ and the extra of pyproject.toml the image installs (nothing else). Build from
# the repository root (compose.yaml does, once per service, with build.args):
#   docker build --build-arg SERVICE=gateway -t tandem/gateway .
# GPU build of the torch services (trainer, inference-worker):
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# (or any index/spec pair, e.g. TORCH_SPEC="torch==2.13.0").
#
# Two stages: the first installs the service into a virtual environment; the image
# copies only that environment, so neither the source tree nor pip's leftovers ship.

FROM python:3.11-slim AS build
ARG SERVICE
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/tandem/bin:$PATH
RUN python -m venv /opt/tandem
WORKDIR /src

# torch first, pinned, from the CPU index unless overridden, for the services that run
# models: a loose requirement would pull a multi-GB CUDA build. Its own layer, before the
# code, so code changes never reinstall it. Any other SERVICE is refused here.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN --mount=type=cache,target=/root/.cache/pip \
    case "${SERVICE}" in \
      trainer|inference-worker) pip install --index-url "${TORCH_INDEX_URL}" ${TORCH_SPEC} ;; \
      gateway|checkpointer|cluster-agent) ;; \
      *) echo "SERVICE='${SERVICE}' is not a folder of services/" >&2; exit 1 ;; \
    esac

COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[${SERVICE}]"


FROM python:3.11-slim
ARG SERVICE
# The ports the service listens on: every service serves /healthz and /metrics on 9100;
# the gateway adds its HTTP API (compose.yaml passes "8000 9100").
ARG PORTS=9100
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tandem/bin:$PATH \
    SERVICE=${SERVICE} \
    TANDEM_LOG_FORMAT=json \
    TANDEM_METRICS_HOST=0.0.0.0 \
    TANDEM_METRICS_PORT=9100
COPY --from=build /opt/tandem /opt/tandem
# tini is PID 1: it passes signals on to the service and reaps what is orphaned under it
# (a crashed torchrun's or pipeline process's children), which a Python service as PID 1
# never waits for: their zombies would pile up until the pod ran out of pids.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# The code stays root-owned (read-only to the service); the work dir is writable.
# /checkpoints is the volume trainer and checkpointer share; a new named volume takes
# this directory's owner, so the unprivileged user can write it (unused elsewhere).
RUN useradd --create-home --uid 10001 tandem \
    && install -d -o tandem /app /checkpoints
WORKDIR /app
USER tandem
EXPOSE ${PORTS}
# The service runner's /healthz: 200 while connected to NATS and not stopping.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ['TANDEM_METRICS_PORT'] + '/healthz', timeout=2)"]
# SIGTERM (docker stop) drains: in-flight work finishes or is handed back, then exit 0.
# tini passes the signal on to the service (python -m tandem.<SERVICE with _ for ->),
# which sh exec-s into, and exits with its code.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["sh", "-c", "exec python -m \"tandem.$(echo \"$SERVICE\" | tr - _)\""]
