# The GPU-backed HTTP server: uvicorn on port 8000 serving every checkpoint in model_store/.
#   docker build -t tinyserve . && docker run --gpus all -p 8000:8000 tinyserve
# The base is NVIDIA's CUDA runtime; torch==2.13.0 from PyPI is the CUDA build (with its cuDNN/cuBLAS
# wheels), pinned in requirements.txt like everything else. The host provides the driver (--gpus all).
FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04

ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.11, as in cog.yaml and CI (the deadsnakes PPA's versions move, so they are not pinned)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv "$VIRTUAL_ENV"

WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt \
    && useradd --create-home --uid 10001 tinyserve
COPY --chown=tinyserve:tinyserve models/ models/
COPY --chown=tinyserve:tinyserve training/ training/
COPY --chown=tinyserve:tinyserve model_store/ model_store/
COPY --chown=tinyserve:tinyserve server/ server/
USER 10001

# CUDA and float16 when a GPU is visible, otherwise CPU and float32 (TINYSERVE_DEVICE / _DTYPE override)
ENV MPLCONFIGDIR=/tmp/matplotlib
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# the server's own entry point: its drain limit outlasts the stream grace period (TINYSERVE_SHUTDOWN_GRACE_S)
CMD ["python", "-m", "server", "--host", "0.0.0.0", "--port", "8000"]
