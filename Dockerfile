# ddpkit training image: one image for every target (local Docker, Kubernetes, Slurm/pyxis).
#
# Online:   docker build -t ddpkit:0.1 .
# Offline:  ddpkit image build --offline     (or: make image WHEELHOUSE=DIR)
#           pip wheels are prepared on the host and installed here with --no-index from a
#           BuildKit bind mount, so nothing is fetched during the build (air-gapped sites, CI).
#
# BASE_IMAGE defaults to the official PyTorch runtime image of the pinned torch release (its
# python already has torch, so pip keeps it). Any Debian/Ubuntu image with python3 (>= 3.11:
# the deps stage reads pyproject.toml with tomllib; venv module included) works too, e.g. a
# bare Debian made with debootstrap: torch then comes from the wheelhouse. No `# syntax=` line
# on purpose: that would pull a frontend image, which an air-gapped daemon cannot do; the
# built-in BuildKit frontend supports RUN --mount.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

# ---- python: the base plus a python3 that can make virtual environments -------------------
FROM ${BASE_IMAGE} AS python
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Only installs when the base lacks python3/venv (the official PyTorch image has both); package
# versions are whatever the base distribution ships, so they are not pinned here.
# hadolint ignore=DL3008
RUN if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# ---- deps: a virtual environment with the dependencies of ddpkit[train] ----------------------
# Its own stage (and layer) so that a code change reinstalls only ddpkit itself, not torch.
FROM python AS deps
# "1" = install only from the wheelhouse (pip --no-index); "0" = also use the package index.
ARG OFFLINE=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
# --system-site-packages: reuse the torch that a PyTorch base image already ships.
RUN python3 -m venv --system-site-packages /opt/ddpkit
# The requirement list comes from pyproject.toml (one source); wheelhouse/ holds the prepared
# wheels (empty for an online build) and is bind-mounted, never copied into a layer. torch is
# pinned there: unpinned, pip resolves a multi-GB CUDA build.
RUN --mount=type=bind,source=pyproject.toml,target=/tmp/pyproject.toml \
    --mount=type=bind,source=wheelhouse,target=/wheels \
    /opt/ddpkit/bin/python -c 'import tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["train"]))' > /tmp/requirements.txt \
    && PIP_NO_INDEX="$OFFLINE" /opt/ddpkit/bin/pip install --find-links /wheels -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# ---- wheel: ddpkit itself, built from the source ------------------------------------------
FROM deps AS wheel
WORKDIR /src
COPY pyproject.toml README.md hatch_build.py ddpkit.py ddpkit_hooks.py ./
COPY deploy/ deploy/
COPY trainer/ trainer/
COPY k8s/ k8s/
COPY slurm/ slurm/
# The build backend (hatchling) comes from the wheelhouse when offline.
RUN --mount=type=bind,source=wheelhouse,target=/wheels \
    PIP_NO_INDEX="$OFFLINE" /opt/ddpkit/bin/pip wheel --no-deps --find-links /wheels \
        --wheel-dir /dist /src

# ---- runtime: the venv, ddpkit itself, a non-root user, the entry point ---------------------
FROM python AS runtime
ARG OFFLINE=0
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="ddpkit" \
      org.opencontainers.image.description="One PyTorch DDP entry point for local, Kubernetes and Slurm runs" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
# NCCL between nodes needs the RDMA verbs library (rdma-core's libibverbs) and its user-space
# drivers (mlx5, efa, ...): without them NCCL logs "Failed to open libibverbs" at INFO only and
# all-reduces over TCP sockets. The PyTorch runtime image has neither. An offline build on a
# base without them says so and goes on (the nodes then talk over sockets). AWS EFA also needs
# the aws-ofi-nccl plugin, which is the cluster's image business (docs/gpus.md).
# hadolint ignore=DL3008
RUN ldconfig -p > /tmp/libs && if ! grep -q 'libibverbs\.so\.1' /tmp/libs; then \
        if [ "$OFFLINE" = 1 ]; then \
            echo "ddpkit image: the base has no libibverbs and the build is offline: NCCL will use TCP sockets between nodes" >&2; \
        else \
            apt-get update \
            && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers \
            && rm -rf /var/lib/apt/lists/*; \
        fi; \
    fi; \
    rm /tmp/libs
COPY --from=deps /opt/ddpkit /opt/ddpkit
# Only the wheel, from a bind mount: neither the source nor the wheel file stays in a layer.
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    /opt/ddpkit/bin/pip install --no-index --no-deps /dist/*.whl \
    && /opt/ddpkit/bin/python -c "import torch, numpy, trainer.launch"
# A fixed uid (1000) so a pod's securityContext.runAsUser and bind-mounted run directories can
# match it; /workspace is its writable home. matplotlib's font cache is built here once, not at
# the end of every run (it takes seconds).
RUN useradd --create-home --home-dir /workspace --uid 1000 --user-group ddpkit \
    && HOME=/workspace /opt/ddpkit/bin/python -c "import matplotlib.font_manager" \
    && chown -R 1000:1000 /workspace
# The NVIDIA container runtime and enroot (pyxis) give a container the driver and its GPUs only
# when the image asks for them; the device plugin / Slurm narrow "all" to the job's GPUs. A CPU
# job's workers are given CUDA_VISIBLE_DEVICES="" by the launcher (trainer/gpus.py).
ENV PATH=/opt/ddpkit/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 1000:1000
WORKDIR /workspace
ENTRYPOINT ["python", "-m", "trainer.launch"]
