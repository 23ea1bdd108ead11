# forewarn: Azure Scheduled Events exporter. Multi-stage: build a wheel, install it into a venv, copy the
# venv onto a slim runtime as a non-root user. Runs with a read-only root filesystem: the only writable
# path it needs is the state dir (/var/lib/forewarn, mount a volume or an emptyDir there).
#
# Build arguments (docs/container.md):
#   BASE     the base of both stages: a Debian-based image with python, python -m venv and groupadd/useradd
#            (the tests build one from Debian's packages with mmdebstrap, scripts/image base)
#   EXTRAS   the extras installed: all (the full image) or slim (core, web, notify, kubernetes)
#   VERSION  the image's version label (the release workflow passes the tag's version)
ARG BASE=python:3.12-slim

FROM ${BASE} AS build
ARG EXTRAS=all
# Behind a TLS-intercepting proxy, pip trusts its CA through a build secret, for this stage only:
#   --secret id=pip-ca,src=/path/to/ca-bundle.pem --build-arg PIP_CERT=/run/secrets/pip-ca
# Neither the bundle nor the variable reaches the image: the final stage has no pip and no such argument.
ARG PIP_CERT
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# pip, setuptools and wheel leave the venv once forewarn is in (nothing installs at run time), and so do
# the test suites some libraries ship inside their package.
RUN --mount=type=secret,id=pip-ca \
    python -m venv /opt/forewarn \
 && /opt/forewarn/bin/pip install --no-cache-dir --disable-pip-version-check ".[${EXTRAS}]" \
 && /opt/forewarn/bin/pip uninstall --yes --no-cache-dir --disable-pip-version-check pip setuptools wheel \
 && find /opt/forewarn/lib -depth -type d -path "*/site-packages/*/tests" -exec rm -r {} +

FROM ${BASE}
ARG VERSION=0.1.0
ARG EXTRAS=all
LABEL org.opencontainers.image.title="forewarn" \
      org.opencontainers.image.description="Advance warning of Azure VM maintenance: Scheduled Events as Prometheus metrics, CloudEvents records and policy-driven approvals" \
      org.opencontainers.image.version="${VERSION}" \
      io.forewarn.extras="${EXTRAS}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/forewarn/forewarn"
RUN groupadd --system --gid 65532 forewarn \
 && useradd --system --uid 65532 --gid forewarn --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin forewarn \
 && mkdir -p /var/lib/forewarn \
 && chown forewarn:forewarn /var/lib/forewarn
COPY --from=build /opt/forewarn /opt/forewarn
ENV PATH="/opt/forewarn/bin:${PATH}" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FOREWARN_STATE_DIR=/var/lib/forewarn \
    FOREWARN_LISTEN_ADDRESS=:9465
USER 65532:65532
VOLUME ["/var/lib/forewarn"]
EXPOSE 9465
HEALTHCHECK --interval=30s --timeout=3s --start-period=150s --retries=3 \
  CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9465/healthz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["forewarn"]
CMD ["run"]
