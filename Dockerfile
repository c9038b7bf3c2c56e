# Image of the pipeline, for docker-compose.yml: the MLflow server, the Prefect server and the Prefect worker
# that runs the flows. Its offline ENV is difflm.OFFLINE_ENV (a native `python -m deploy.stack up` sets the same;
# tests/integration/test_production_stack.py checks that they agree).
# CPU torch by default; for GPUs build FROM an NGC PyTorch image and install '.[gpu]'.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=true \
    MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY difflm difflm
COPY data_prep data_prep
COPY models models
COPY tasks tasks
COPY flows flows
COPY configs configs
COPY prefect.yaml ./
COPY deploy deploy
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install -e '.[stack]'
CMD ["difflm", "--help"]
