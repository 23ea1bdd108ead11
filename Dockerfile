# forewarn: Azure Scheduled Events exporter. Multi-stage: build a wheel, install it into a venv, copy the
# venv onto a slim runtime as a non-root user. Runs with a read-only root filesystem: the only writable
# path it needs is the state dir (/var/lib/forewarn, mount a volume or an emptyDir there).
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN python -m venv /opt/forewarn \
 && /opt/forewarn/bin/pip install --no-cache-dir --disable-pip-version-check ".[all]"

FROM python:3.12-slim
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="forewarn" \
      org.opencontainers.image.description="Advance warning of Azure VM maintenance: Scheduled Events as Prometheus metrics, CloudEvents records and policy-driven approvals" \
      org.opencontainers.image.version="${VERSION}" \
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
