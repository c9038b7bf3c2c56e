# PostgreSQL 15 from Debian's package, with the official postgres image's environment contract as
# docker-compose.yml uses it: POSTGRES_PASSWORD (superuser `postgres`), PGDATA=/var/lib/postgresql/data, the
# scripts of /docker-entrypoint-initdb.d run once on a fresh cluster, password (scram) logins over TCP.
# For hosts without the official image:
#   docker build -f deploy/docker/postgres.Dockerfile -t difflm-postgres:15 deploy/docker
#   DIFFLM_POSTGRES_IMAGE=difflm-postgres:15 docker compose up -d     (or set it in .env)
ARG FROM_IMAGE=debian:bookworm-slim
FROM ${FROM_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/postgresql/data /var/run/postgresql /docker-entrypoint-initdb.d \
 && chown postgres:postgres /var/lib/postgresql/data /var/run/postgresql && chmod 700 /var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
VOLUME /var/lib/postgresql/data
USER postgres
EXPOSE 5432
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
