# The HTTP server image: uvicorn on port 8000 serving every checkpoint in model_store/.
#   GPU (default): docker build -t tinyserve . && docker run --gpus all -p 8000:8000 tinyserve
#     The base is NVIDIA's CUDA runtime; torch==2.13.0 from PyPI is the CUDA build (with its cuDNN/cuBLAS
#     wheels), pinned in requirements.txt like everything else. The host provides the driver (--gpus all).
#   CPU: BASE_IMAGE a Debian bookworm base and WHEELS a folder holding torch's CPU wheel, bind-mounted
#     at build time; `make image-test` builds it that way with podman and serves from inside it.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04
FROM ${BASE_IMAGE}

ARG DEBIAN_FRONTEND=noninteractive
# a folder of wheels pip prefers over PyPI's (torch's CPU build); empty: PyPI only
ARG WHEELS=""
# a CA bundle for pip, bind-mounted at build time, where a proxy re-signs TLS; empty: pip's own
ARG CA_BUNDLE=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.11, as in cog.yaml and CI: the base's own where its python3 is 3.11 (Debian bookworm, with
# g++ and the Python headers for torch.compile's CPU kernels), else from the deadsnakes PPA (Ubuntu 22.04,
# the CUDA base; the PPA's versions move, so they are not pinned)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-cache show python3 > /tmp/python3.info \
    && if grep -q '^Version: 3\.11\.' /tmp/python3.info; then \
         apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev g++ libgomp1; \
       else \
         apt-get install -y --no-install-recommends software-properties-common \
         && add-apt-repository -y ppa:deadsnakes/ppa \
         && apt-get install -y --no-install-recommends python3.11 python3.11-venv; \
       fi \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /tmp/python3.info \
    && python3.11 -m venv "$VIRTUAL_ENV"

WORKDIR /app
COPY requirements.txt constraints.txt ./
RUN pip install --no-cache-dir ${WHEELS:+--find-links "$WHEELS"} ${CA_BUNDLE:+--cert "$CA_BUNDLE"} \
        -c constraints.txt -r requirements.txt \
    && useradd --create-home --uid 10001 tinyserve
# only what `python -m server` imports, and the checkpoints
COPY --chown=tinyserve:tinyserve models/ models/
COPY --chown=tinyserve:tinyserve model_store/ model_store/
COPY --chown=tinyserve:tinyserve server/ server/
USER 10001

# CUDA and float16 when a GPU is visible, otherwise the CPU (TINYSERVE_DEVICE / _DTYPE override)
ENV MPLCONFIGDIR=/tmp/matplotlib
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# the server's own entry point: its drain limit outlasts the stream grace period (TINYSERVE_SHUTDOWN_GRACE_S)
CMD ["python", "-m", "server", "--host", "0.0.0.0", "--port", "8000"]
