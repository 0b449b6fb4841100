# syntax=docker/dockerfile:1
# One image for every splitserve process (gateway, prefill and decode workers, autoscaler); the
# command picks the process. VARIANT selects the torch build:
#   docker build --build-arg VARIANT=cpu  -t splitserve:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t splitserve:0.1.0-cuda .
# Model weights are not baked in: the Helm chart mounts them read-only from a volume.
# checkov:skip=CKV_DOCKER_2: no HEALTHCHECK; Kubernetes probes each process on its own port and path (the chart's startup, liveness and readiness probes), and the command differs by role

ARG VARIANT=cpu

# The one base of both stages: the same Python builds the venv and runs it.
FROM python:3.11.11-slim-bookworm AS python-base

# ---- build: one virtualenv with torch for the variant, the project and its gRPC stubs ----------
FROM python-base AS build
ARG VARIANT
# pyproject.toml pins the same version (tests/k8s/test_dockerfile.py keeps them equal).
ARG TORCH_VERSION=2.13.0
# The CUDA build's wheel index; the wheels carry their CUDA runtime, the node brings the driver.
ARG TORCH_CUDA=cu130
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/splitserve/venv/bin:$PATH
# torch goes in first, from the variant's index: left to the resolver, PyPI's Linux wheel would
# be the CUDA build even for the CPU image.
RUN case "${VARIANT}" in \
        cpu) index="https://download.pytorch.org/whl/cpu" ;; \
        cuda) index="https://download.pytorch.org/whl/${TORCH_CUDA}" ;; \
        *) echo "VARIANT must be cpu or cuda, not '${VARIANT}'" >&2; exit 1 ;; \
    esac \
    && python -m venv /opt/splitserve/venv \
    && pip install --index-url "${index}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY kernels/ kernels/
COPY kv_transfer/ kv_transfer/
COPY services/ services/
COPY splitserve_cli/ splitserve_cli/
COPY protos/splitserve/ protos/splitserve/
# The torch above satisfies pyproject's torch==X pin, so pip keeps that build. The gRPC stubs go
# straight into site-packages, importable as `splitserve.v1` like `make protos` makes them.
RUN pip install . \
    && site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && python -m grpc_tools.protoc -Iprotos --python_out="${site}" --grpc_python_out="${site}" \
        protos/splitserve/v1/*.proto \
    && python -c "import torch; from splitserve.v1 import decode_pb2_grpc, prefill_pb2_grpc; print('torch', torch.__version__)"

# ---- runtime ------------------------------------------------------------------------------------
FROM python-base AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="splitserve" \
      org.opencontainers.image.description="Disaggregated prefill/decode LLM serving (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0"
# On GPUs, Triton compiles a small C launcher for its kernels at run time: it needs gcc and the
# libc headers.
# checkov:skip=CKV_DOCKER_9: apt installs gcc and libc6-dev in the cuda variant only, which Triton needs at run time
RUN if [ "${VARIANT}" = cuda ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 splitserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin splitserve
COPY --from=build /opt/splitserve/venv /opt/splitserve/venv
# The chart mounts the root filesystem read-only: every cache goes under /tmp (an emptyDir).
ENV PATH=/opt/splitserve/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    SPLITSERVE_IMAGE_VARIANT=${VARIANT} \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64
# (LD_LIBRARY_PATH: where GKE's driver installer puts libcuda; the NVIDIA container toolkit
# injects it into the system paths elsewhere, and a missing folder is ignored.)
WORKDIR /tmp
# A fixed, high uid/gid that the chart's securityContext names (runAsUser 10001).
USER 10001:10001
# gateway HTTP, gateway gRPC, worker gRPC, decode KV rendezvous, metrics and health.
EXPOSE 8000 50050 50051 50052 9100
ENTRYPOINT ["splitserve"]
CMD ["--help"]
