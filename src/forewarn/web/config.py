"""The web configuration file (`--web.config.file`) in the Prometheus exporter-toolkit format.

The same file node_exporter and blackbox_exporter take, with the same meaning:

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert, VerifyClientCertIfGiven
      client_ca_file: clients-ca.crt
      min_version: TLS12             # TLS10 .. TLS13; default TLS12
      max_version: TLS13
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # TLS 1.2 and below, as in Go
      prefer_server_cipher_suites: true
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      prometheus: $2b$12$...         # bcrypt hashes (htpasswd -nBC 12 prometheus)

What Python's ssl module cannot do is refused by name rather than ignored: RequestClientCert and
RequireAnyClientCert (accepting a client certificate without verifying it), curve_preferences,
client_allowed_sans, inline `cert`/`key`, rate_limit. `WebGate` holds the loaded configuration for the
HTTP server: it re-reads the file and the certificate files when one of them changes (checked at most
once a second, when a connection or request comes), keeping the last good configuration when the new
one is refused.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forewarn.config import ConfigError, read_text_file
from forewarn.web.server import Request, Response
from forewarn.yamlerrors import YamlSyntaxError, load_yaml

log = logging.getLogger(__name__)

OPTION = "--web.config.file"

#: min_version / max_version spellings of the exporter-toolkit.
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}

#: client_auth_type values Python's ssl can honour: it verifies every certificate it asks for.
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}

#: Go's cipher suite names (as the toolkit takes them) and OpenSSL's for the same suite. Like Go, they
#: choose among TLS 1.2 and older suites; TLS 1.3's are not configurable.
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
}

#: The response headers the toolkit lets a user set (others could break the protocol).
ALLOWED_HEADERS = ("Cache-Control", "Content-Security-Policy", "Strict-Transport-Security",
                   "X-Content-Type-Options", "X-Frame-Options", "X-XSS-Protection")

_UNSUPPORTED = {
    "RequestClientCert": "Python's ssl verifies every client certificate it asks for; use VerifyClientCertIfGiven",
    "RequireAnyClientCert": "Python's ssl verifies every client certificate it asks for; use "
                            "RequireAndVerifyClientCert",
}
_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users")
_TLS_KEYS = ("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
             "cipher_suites", "prefer_server_cipher_suites")
_NOT_HONOURED = {"rate_limit", "curve_preferences", "client_allowed_sans", "cert", "key", "client_ca"}

#: Verified credentials remembered, so a scrape every few seconds does not pay a bcrypt (about 0.1 to
#: 0.3 s of CPU at cost 10 to 12) each time; the oldest are forgotten past this many.
AUTH_CACHE_SIZE = 256
#: How often, at most, the files' modification times are looked at.
RELOAD_CHECK_SECONDS = 1.0


class WebConfigError(ConfigError):
    """The web configuration file is unusable; the message names the file and the key."""


@dataclass(frozen=True)
class WebConfig:
    """One loaded web configuration: the TLS context (None: plain HTTP), the users (name -> bcrypt hash;
    empty: no authentication), the extra response headers, and the files it was read from."""

    tls: ssl.SSLContext | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    files: tuple[Path, ...] = ()


def _problem(path: Path, key: str, message: str) -> WebConfigError:
    return WebConfigError(f"{OPTION} {path}: {key}: {message}")


def _string(path: Path, section: Mapping[str, Any], parent: str, key: str) -> str | None:
    value = section.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _problem(path, f"{parent}.{key}", "expected a non-empty string")
    return value


def _file(path: Path, section: Mapping[str, Any], parent: str, key: str) -> Path | None:
    name = _string(path, section, parent, key)
    if name is None:
        return None
    resolved = path.parent / name  # as the toolkit does: relative to the configuration file
    if not resolved.is_file():
        raise _problem(path, f"{parent}.{key}", f"{resolved} is not a readable file")
    return resolved


def _mapping(path: Path, value: Any, key: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _problem(path, key, "expected a mapping")
    return value


def _known_keys(path: Path, section: Mapping[str, Any], parent: str, valid: tuple[str, ...]) -> None:
    for key in section:
        if key in valid:
            continue
        if key in _NOT_HONOURED:
            raise _problem(path, f"{parent}{key}", "not supported by forewarn (Python's ssl or this server "
                                                   "cannot honour it)")
        raise _problem(path, f"{parent}{key}", f"unknown key; valid: {', '.join(valid)}")


def _tls_context(path: Path, section: Mapping[str, Any]) -> tuple[ssl.SSLContext, tuple[Path, ...]]:
    where = "tls_server_config"
    _known_keys(path, section, where + ".", _TLS_KEYS)
    cert = _file(path, section, where, "cert_file")
    key = _file(path, section, where, "key_file")
    if cert is None:
        raise _problem(path, f"{where}.cert_file", "missing (the server certificate, PEM)")
    if key is None:
        raise _problem(path, f"{where}.key_file", "missing (the server's private key, PEM)")
    versions = {}
    for name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        value = section.get(name, default)
        if value not in TLS_VERSIONS:
            raise _problem(path, f"{where}.{name}", f"{value!r} is not valid; valid: {', '.join(TLS_VERSIONS)}")
        versions[name] = TLS_VERSIONS[value]
    if versions["min_version"] > versions["max_version"]:
        raise _problem(path, f"{where}.min_version", "is above max_version")
    client_ca = _file(path, section, where, "client_ca_file")
    # As in the toolkit: client CAs without a policy mean that a verified certificate is required.
    auth_type = section.get("client_auth_type") or ("RequireAndVerifyClientCert" if client_ca else "NoClientCert")
    if auth_type in _UNSUPPORTED:
        raise _problem(path, f"{where}.client_auth_type", f"{auth_type} is not supported: {_UNSUPPORTED[auth_type]}")
    if auth_type not in CLIENT_AUTH:
        raise _problem(path, f"{where}.client_auth_type",
                       f"{auth_type!r} is not valid; valid: {', '.join(CLIENT_AUTH)}")
    if CLIENT_AUTH[auth_type] != ssl.CERT_NONE and client_ca is None:
        raise _problem(path, f"{where}.client_ca_file", f"needed with client_auth_type {auth_type}")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = versions["min_version"]
    context.maximum_version = versions["max_version"]
    try:
        # An empty password: an encrypted key fails here instead of prompting on the terminal.
        context.load_cert_chain(cert, key, password=b"")
    except (ssl.SSLError, OSError) as exc:
        raise _problem(path, f"{where}.cert_file/key_file", f"cannot load {cert} and {key} "
                       f"({getattr(exc, 'reason', None) or exc})") from None
    context.verify_mode = CLIENT_AUTH[auth_type]
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=str(client_ca))
        except (ssl.SSLError, OSError) as exc:
            raise _problem(path, f"{where}.client_ca_file", f"cannot load {client_ca} "
                           f"({getattr(exc, 'reason', None) or exc})") from None
    suites = section.get("cipher_suites")
    if suites is not None:
        if not isinstance(suites, list) or not suites:
            raise _problem(path, f"{where}.cipher_suites", "expected a non-empty list of cipher suite names")
        unknown = [name for name in suites if name not in CIPHER_SUITES]
        if unknown:
            raise _problem(path, f"{where}.cipher_suites", f"{unknown[0]!r} is not a suite Python's ssl can "
                           f"use; valid: {', '.join(CIPHER_SUITES)}")
        try:
            context.set_ciphers(":".join(CIPHER_SUITES[name] for name in suites))
        except ssl.SSLError:
            raise _problem(path, f"{where}.cipher_suites", "none of these suites is available in this "
                           "OpenSSL") from None
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise _problem(path, f"{where}.prefer_server_cipher_suites", "expected true or false")
    if prefer:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    files = tuple(p for p in (cert, key, client_ca) if p is not None)
    return context, files


def _users(path: Path, section: Mapping[str, Any]) -> dict[str, bytes]:
    users: dict[str, bytes] = {}
    for name, hashed in section.items():
        where = f"basic_auth_users.{name}"
        if not isinstance(name, str) or not name or ":" in name:
            raise _problem(path, where, "a user name must be a non-empty string without ':'")
        # bcrypt's own formats: $2a$, $2b$, $2y$, cost, 53 characters of salt and hash. The hash is not
        # repeated in the message: it is a secret too (it can be attacked offline).
        if not isinstance(hashed, str) or len(hashed) != 60 or hashed[:4] not in ("$2a$", "$2b$", "$2y$"):
            raise _problem(path, where, "not a bcrypt hash (make one with: htpasswd -nBC 12 USER)")
        users[name] = hashed.encode()
    if users:
        try:
            import bcrypt  # noqa: F401  (loaded here so a missing extra is a start-up error, not a 500)
        except ImportError:
            raise _problem(path, "basic_auth_users", "needs the bcrypt package: pip install 'forewarn[web]'") \
                from None
    return users


def _headers(path: Path, section: Mapping[str, Any]) -> dict[str, str]:
    where = "http_server_config"
    _known_keys(path, section, where + ".", ("headers", "http2"))
    headers: dict[str, str] = {}
    allowed = {name.lower(): name for name in ALLOWED_HEADERS}
    for name, value in _mapping(path, section.get("headers"), f"{where}.headers").items():
        if str(name).lower() not in allowed:
            raise _problem(path, f"{where}.headers.{name}", f"cannot be set; valid: {', '.join(ALLOWED_HEADERS)}")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
            raise _problem(path, f"{where}.headers.{name}", "expected a one-line string")
        headers[allowed[str(name).lower()]] = value
    return headers


def load_web_config(file: str | Path) -> WebConfig:
    """Read and check the web configuration file; WebConfigError names the file and the key."""
    path = Path(file)
    text = read_text_file(str(path), OPTION)
    try:
        data = load_yaml(text, f"{OPTION} {path}")
    except YamlSyntaxError as exc:
        raise WebConfigError(str(exc)) from None
    top = _mapping(path, data, "(top level)")
    _known_keys(path, top, "", _TOP_KEYS)
    tls: ssl.SSLContext | None = None
    tls_files: tuple[Path, ...] = ()
    if top.get("tls_server_config") is not None:
        tls, tls_files = _tls_context(path, _mapping(path, top["tls_server_config"], "tls_server_config"))
    users = _users(path, _mapping(path, top.get("basic_auth_users"), "basic_auth_users"))
    headers = _headers(path, _mapping(path, top.get("http_server_config"), "http_server_config"))
    return WebConfig(tls, users, headers, (path, *tls_files))


class BasicAuth:
    """Checks `Authorization: Basic` against bcrypt hashes, remembering the outcome for recent credentials.

    The cache is keyed on an HMAC (with a key made at start) of the user, the password and the stored
    hash, so it holds no password, and a changed hash misses. An unknown user costs a bcrypt like a known
    one, so answer times do not tell which users exist.
    """

    def __init__(self, size: int = AUTH_CACHE_SIZE) -> None:
        self.size = size
        self._key = secrets.token_bytes(32)
        self._cache: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._dummy: dict[bytes, bytes] = {}  # bcrypt cost prefix -> a hash of nothing, for unknown users
        self.bcrypt_calls = 0  # for the benchmark and the tests: how often a bcrypt was paid

    def allows(self, users: Mapping[str, bytes], authorization: str | None) -> bool:
        credentials = _basic_credentials(authorization)
        if credentials is None:
            return False
        user, password = credentials
        known = users.get(user.decode("utf-8", "replace"))
        stored = known if known is not None else self._dummy_hash(next(iter(users.values())))
        digest = hmac.new(self._key, b"\0".join((user, password, stored)), hashlib.sha256).digest()
        with self._lock:
            cached = self._cache.get(digest)
            if cached is not None:
                self._cache.move_to_end(digest)
                return cached and known is not None
        import bcrypt

        self.bcrypt_calls += 1
        try:
            matched = bool(bcrypt.checkpw(password, stored))  # compares in constant time
        except ValueError:  # a hash bcrypt cannot read: refused, like a wrong password
            matched = False
        matched = matched and known is not None
        with self._lock:
            self._cache[digest] = matched
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return matched

    def _dummy_hash(self, like: bytes) -> bytes:
        prefix = like[:7]  # "$2b$12$": the same cost as a real user's, so the same time
        dummy = self._dummy.get(prefix)
        if dummy is None:
            import bcrypt

            try:
                rounds = int(prefix[4:6])
            except ValueError:
                rounds = 12
            dummy = self._dummy[prefix] = bcrypt.hashpw(b"", bcrypt.gensalt(rounds))
        return dummy


def _basic_credentials(authorization: str | None) -> tuple[bytes, bytes] | None:
    if not authorization:
        return None
    scheme, _, encoded = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(b":")
    return (user, password) if colon else None


UNAUTHORIZED = Response(401, b"Unauthorized\n", headers={"WWW-Authenticate": 'Basic realm="forewarn"'})


class WebGate:
    """The web configuration in force, for HttpServer: the TLS context for each new connection, the check
    of each request's credentials, and the extra response headers.

    When the configuration file or one of its certificate files changes (mtime or size; looked at no more
    than once per `check_every` seconds), it is loaded again. A refused file is logged and the last good
    configuration stays, until the files change again. Whether TLS is on is fixed at start: the port's
    scheme is in every scraper's configuration.
    """

    def __init__(self, file: str | Path, check_every: float = RELOAD_CHECK_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.file = Path(file)
        self.check_every = check_every
        self.clock = clock
        self.config = load_web_config(self.file)
        self.auth = BasicAuth()
        self.reloads = 0
        self.failed_reloads = 0
        self._seen = self._signature(self.config.files)
        self._checked = clock()
        self._lock = threading.Lock()

    @property
    def tls_enabled(self) -> bool:
        return self.config.tls is not None

    def current(self) -> WebConfig:
        now = self.clock()
        if now - self._checked < self.check_every:
            return self.config
        if not self._lock.acquire(blocking=False):  # another thread is checking: use what is there
            return self.config
        try:
            self._checked = now
            # The file may now name other certificate files: look at both the old and the new set.
            signature = self._signature(self.config.files)
            if signature != self._seen:
                self._seen = signature
                self._reload()
        finally:
            self._lock.release()
        return self.config

    def _reload(self) -> None:
        try:
            config = load_web_config(self.file)
            if (config.tls is None) != (self.config.tls is None):
                raise WebConfigError(f"{OPTION} {self.file}: tls_server_config: TLS cannot be switched "
                                     f"{'on' if config.tls else 'off'} without a restart")
        except ConfigError as exc:
            self.failed_reloads += 1
            log.error("web: cannot reload the web configuration (%s); keeping the previous one", exc)
            return
        self.config = config
        self._seen = self._signature(config.files)
        self.reloads += 1
        log.info("web: reloaded %s (TLS %s, %d basic auth user(s))", self.file,
                 "on" if config.tls else "off", len(config.users))

    @staticmethod
    def _signature(files: tuple[Path, ...]) -> tuple[tuple[str, int, int], ...]:
        shown = []
        for path in files:
            try:
                stat = os.stat(path)  # follows symlinks: a Kubernetes Secret swaps its ..data link
                shown.append((str(path), stat.st_mtime_ns, stat.st_size))
            except OSError:
                shown.append((str(path), -1, -1))
        return tuple(shown)

    # --- what HttpServer calls ---------------------------------------------------------------------
    def tls_context(self) -> ssl.SSLContext | None:
        return self.current().tls

    def check(self, request: Request) -> Response | None:
        """None when the request may go on; the 401 answer otherwise."""
        config = self.current()
        if not config.users or self.auth.allows(config.users, request.headers.get("Authorization")):
            return None
        return UNAUTHORIZED

    def headers(self) -> Mapping[str, str]:
        return self.config.headers
