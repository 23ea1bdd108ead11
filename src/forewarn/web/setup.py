"""The web server from settings, for `run` and `fleet` alike: --web.config.file and --listen-address."""

from __future__ import annotations

from typing import TYPE_CHECKING

from forewarn.config import ConfigError, Settings, parse_listen_address
from forewarn.web.server import HttpServer

if TYPE_CHECKING:  # bcrypt and the TLS configuration load only with --web.config.file
    from forewarn.web.config import WebGate


def web_gate(settings: Settings) -> WebGate | None:
    """TLS and basic auth from --web.config.file, when given; a refused file is a ConfigError (exit 2, the
    file and key named)."""
    if not settings.web_config_file:
        return None
    from forewarn.web.config import WebGate

    return WebGate(settings.web_config_file)


def web_server(settings: Settings, gate: WebGate | None) -> HttpServer:
    """The web server of /metrics, /healthz and /readyz on --listen-address (not started yet)."""
    host, port = parse_listen_address(settings.listen_address)
    try:
        return HttpServer(host, port, name="metrics-http", read_timeout=settings.web_read_timeout, gate=gate,
                          max_connections=settings.web_max_connections,
                          max_request_bytes=settings.web_max_request_bytes)
    except OSError as exc:
        raise ConfigError(f"--listen-address {settings.listen_address}: cannot listen ({exc.strerror or exc})") \
            from None
