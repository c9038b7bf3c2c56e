# Image of the pipeline, for docker-compose.yml: the MLflow server, the Prefect server and the Prefect worker
# that runs the flows. Its offline ENV is difflm.OFFLINE_ENV (a native `python -m deploy.stack up` sets the same;
# tests/integration/test_production_stack.py checks that they agree).
#   docker build -t difflm-pipeline:latest .                       # base: the official python:3.11-slim
#   docker build --build-arg BASE_IMAGE=<a Python 3.11 image> ...  # any Debian-like base with python and venv
# CPU torch, pinned (an unpinned torch pulls a multi-GB CUDA build); the image checks that it has no CUDA.
# Layers: the dependencies (~2 GB) are built from pyproject.toml alone, so a source change rebuilds only the last,
# small layers; the compiler-free runtime stage gets the finished virtual environment, the last stage the project.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
COPY pyproject.toml /tmp/pyproject.toml
# setuptools: the build backend, so the project installs below without fetching anything
RUN python -m venv /opt/venv \
 && python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['stack'], 'setuptools>=68', sep='\n')" > /tmp/requirements.txt \
 && pip install --no-deps --index-url "$TORCH_INDEX_URL" torch==2.13.0+cpu \
 && pip install -r /tmp/requirements.txt \
 && python -c "import torch; assert torch.version.cuda is None, torch.__version__" \
 && find /opt/venv -name __pycache__ -prune -exec rm -rf {} + \
 && rm /tmp/requirements.txt /tmp/pyproject.toml

# the runtime without the project: a stage of its own, so a host can keep it cached between source builds
FROM ${BASE_IMAGE} AS runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
# the services run as this user; /data (runs, data cache) and /mlartifacts are the named volumes' mount points
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/difflm --shell /usr/sbin/nologin difflm \
 && mkdir -p /data /mlartifacts && chown difflm:difflm /data /mlartifacts && chmod 700 /data /mlartifacts
COPY --from=deps /opt/venv /opt/venv

FROM runtime
WORKDIR /app
COPY pyproject.toml README.md prefect.yaml ./
COPY difflm difflm
COPY data_prep data_prep
COPY models models
COPY tasks tasks
COPY flows flows
COPY configs configs
COPY deploy deploy
RUN pip install --no-deps --no-build-isolation --quiet -e . && rm -rf build
# the Prefect server writes its UI (with the API URL filled in) at start: not into the root-owned venv
ENV PREFECT_UI_STATIC_DIRECTORY=/home/difflm/.prefect/ui
USER difflm
CMD ["difflm", "--help"]
