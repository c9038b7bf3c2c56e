#!/bin/sh
# Roles and databases of the MLflow and Prefect servers, created once on a fresh PostgreSQL cluster:
# docker compose mounts this file into /docker-entrypoint-initdb.d; `python -m deploy.stack up` runs it too.
# The passwords come from the environment (.env, see deploy/stack.env.example), never from this file.
set -eu
psql -v ON_ERROR_STOP=1 --username "${POSTGRES_USER:-postgres}" --dbname postgres \
     -v mlflow_pw="$MLFLOW_DB_PASSWORD" -v prefect_pw="$PREFECT_DB_PASSWORD" <<'SQL'
CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_pw';
CREATE DATABASE mlflow OWNER mlflow;
CREATE DATABASE mlflow_auth OWNER mlflow;
CREATE ROLE prefect LOGIN PASSWORD :'prefect_pw';
CREATE DATABASE prefect OWNER prefect;
SQL
