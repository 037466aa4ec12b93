# Two images from one file:
#   docker build --target api    -t mpjobs-api .     # FastAPI, no TensorFlow
#   docker build --target worker -t mpjobs-worker .  # GPU TensorFlow (CUDA wheels from PyPI): the worker-gpu extra
#   docker build --target tensorboard -t mpjobs-tb . # TensorBoard over the artifacts volume
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# The API and the worker run from here (app/, worker/); pip installs only the client package, mpjobs,
# with the extras that give the API's or the worker's dependencies.
WORKDIR /srv
ENV PYTHONPATH=/srv
COPY pyproject.toml README.md ./
COPY app ./app
COPY mpjobs ./mpjobs
COPY worker ./worker

FROM base AS api
RUN pip install ".[api]"
RUN useradd --create-home mpjobs && mkdir -p /data/artifacts /data/datasets && chown -R mpjobs /data
USER mpjobs
ENV ARTIFACTS_DIR=/data/artifacts DATA_ROOT=/data/datasets
EXPOSE 8000
HEALTHCHECK CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"
CMD ["uvicorn", "app.main:app", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS worker
ARG EXTRAS=worker-gpu
RUN pip install ".[${EXTRAS}]"
RUN useradd --create-home mpjobs && mkdir -p /data/artifacts /data/datasets && chown -R mpjobs /data
USER mpjobs
ENV ARTIFACTS_DIR=/data/artifacts DATA_ROOT=/data/datasets TF_CPP_MIN_LOG_LEVEL=2
CMD ["python", "-m", "worker"]

FROM python:3.11-slim AS tensorboard
# The version pyproject.toml pins for the workers that write the event files.
RUN pip install --no-cache-dir tensorboard==2.21.0
RUN useradd --create-home mpjobs
USER mpjobs
EXPOSE 6006
CMD ["tensorboard", "--logdir", "/data/artifacts", "--bind_all", "--port", "6006"]
