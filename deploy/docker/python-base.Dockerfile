# A Python 3.11 base from Debian's packages, for hosts that reach no image registry (the slow Docker test builds
# it on a `docker import`ed debootstrap of bookworm): the pipeline image's BASE_IMAGE instead of python:3.11-slim.
#   docker build -f deploy/docker/python-base.Dockerfile --build-arg FROM_IMAGE=local/bookworm:minbase \
#     -t local/python:3.11-bookworm <folder with this host's ca-certificates.crt>
ARG FROM_IMAGE=debian:bookworm-slim
FROM ${FROM_IMAGE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* && ln -s /usr/bin/python3 /usr/local/bin/python
# this host's CA bundle (a proxy's CA, if any): pip verifies the package index against it
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
