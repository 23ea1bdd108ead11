"""TLS and basic auth on the web endpoints (--web.config.file, exporter-toolkit format), over real TLS on
loopback with certificates made here, and a real Prometheus scraping forewarn over TLS with basic auth."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from forewarn.cli import main
from forewarn.config import ConfigError
from forewarn.metrics.view import View
from forewarn.web.config import WebGate, load_web_config
from forewarn.web.endpoints import DrainPolicy, add_lb_probe, add_metrics_endpoints, exposition
from forewarn.web.server import HttpServer

from conftest import free_port, require_tool, wait_until

PASSWORD = "correct horse"


@dataclass
class Issued:
    cert: Path
    key: Path
    serial: int


class Authority:
    """A test CA that issues server and client certificates as PEM files."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.certificate = (
            x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256()))
        self.path = directory / f"{name}.crt"
        self.path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, server: bool) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                  else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        issued = Issued(self.directory / f"{name}.crt", self.directory / f"{name}.key", certificate.serial_number)
        issued.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
        return issued


@dataclass
class Pki:
    ca: Authority
    server: Issued
    client_ca: Authority
    client: Issued
    hashed: str  # bcrypt of PASSWORD, cost 4 (the lowest: the tests measure behaviour, not cost)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory, "server-ca")
    client_ca = Authority(directory, "client-ca")
    return Pki(ca, ca.issue("server", True), client_ca, client_ca.issue("client", False),
               bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode())


def write_config(path: Path, pki: Pki, *, users: dict[str, str] | None = None, **tls: Any) -> Path:
    config: dict[str, Any] = {"tls_server_config": {"cert_file": str(pki.server.cert),
                                                    "key_file": str(pki.server.key), **tls}}
    if users is not None:
        config["basic_auth_users"] = users
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Path], tuple[HttpServer, WebGate]]]:
    """An HttpServer with the agent's endpoints behind the WebGate of a config file."""
    started: list[HttpServer] = []

    def start(config: Path, check_every: float = 0.05) -> tuple[HttpServer, WebGate]:
        gate = WebGate(config, check_every=check_every)
        server = HttpServer("127.0.0.1", 0, read_timeout=2.0, gate=gate)
        add_metrics_endpoints(server, exposition(lambda accept: (b"metric 1\n", "text/plain")), lambda: (True, "ok"))
        add_lb_probe(server, View, DrainPolicy())  # an empty view: nothing scheduled
        server.start()
        started.append(server)
        return server, gate

    yield start
    for server in started:
        server.stop()


def client_context(pki: Pki, *, cert: Issued | None = None, maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca.path))
    if cert is not None:
        context.load_cert_chain(cert.cert, cert.key)
    if maximum is not None:
        context.minimum_version = ssl.TLSVersion.TLSv1_2 if maximum == ssl.TLSVersion.TLSv1_2 else maximum
        context.maximum_version = maximum
    return context


def get(server: HttpServer, path: str, context: ssl.SSLContext, auth: tuple[str, str] | None = None
        ) -> http.client.HTTPResponse:
    import base64

    connection = http.client.HTTPSConnection("127.0.0.1", server.server_address[1], context=context, timeout=5)
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    connection.request("GET", path, headers=headers)
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def test_basic_auth_over_tls_takes_the_right_password_and_refuses_others_with_401(
        tmp_path: Path, pki: Pki, serve: Callable[..., tuple[HttpServer, WebGate]]) -> None:
    server, gate = serve(write_config(tmp_path / "web.yml", pki, users={"prometheus": pki.hashed}))
    context = client_context(pki)
    assert server.url.startswith("https://")
    assert get(server, "/metrics", context, ("prometheus", PASSWORD)).status == 200
    for auth in (("prometheus", "wrong"), ("nobody", PASSWORD), None):
        refused = get(server, "/metrics", context, auth)
        assert refused.status == 401, auth
        assert refused.getheader("WWW-Authenticate", "").startswith("Basic"), auth
    # Every path is behind the password, unknown ones too (no telling which exist), but the probes.
    assert get(server, "/nowhere", context).status == 401
    assert get(server, "/", context).status == 401
    for public in ("/healthz", "/readyz", "/probe/lb"):
        assert get(server, public, context).status == 200, public
    # Repeated scrapes with the same credentials pay bcrypt once.
    before = gate.auth.bcrypt_calls
    for _ in range(5):
        assert get(server, "/metrics", context, ("prometheus", PASSWORD)).status == 200
    assert gate.auth.bcrypt_calls == before


def test_a_required_client_certificate_is_enforced(
        tmp_path: Path, pki: Pki, serve: Callable[..., tuple[HttpServer, WebGate]]) -> None:
    server, _ = serve(write_config(tmp_path / "web.yml", pki, client_auth_type="RequireAndVerifyClientCert",
                                   client_ca_file=str(pki.client_ca.path)))
    assert get(server, "/metrics", client_context(pki, cert=pki.client)).status == 200
    with pytest.raises((ssl.SSLError, ConnectionError)):
        get(server, "/metrics", client_context(pki))
    # A certificate from another CA (here: the server's own) is refused too.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        get(server, "/metrics", client_context(pki, cert=pki.server))


def test_tls_below_the_minimum_version_is_refused(
        tmp_path: Path, pki: Pki, serve: Callable[..., tuple[HttpServer, WebGate]]) -> None:
    server, _ = serve(write_config(tmp_path / "web.yml", pki, min_version="TLS13"))
    assert get(server, "/metrics", client_context(pki, maximum=ssl.TLSVersion.TLSv1_3)).status == 200
    with pytest.raises(ssl.SSLError):
        get(server, "/metrics", client_context(pki, maximum=ssl.TLSVersion.TLSv1_2))


def test_plain_http_to_the_tls_port_gets_a_clear_400_at_once(
        tmp_path: Path, pki: Pki, serve: Callable[..., tuple[HttpServer, WebGate]]) -> None:
    server, _ = serve(write_config(tmp_path / "web.yml", pki))
    started = time.monotonic()
    response = requests.get(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5)
    assert time.monotonic() - started < 1.0
    assert response.status_code == 400
    assert "HTTP request to an HTTPS server" in response.text


def test_a_silent_or_half_finished_handshake_does_not_hold_up_other_clients(
        tmp_path: Path, pki: Pki, serve: Callable[..., tuple[HttpServer, WebGate]]) -> None:
    server, _ = serve(write_config(tmp_path / "web.yml", pki))
    address = ("127.0.0.1", server.server_address[1])
    silent = socket.create_connection(address)
    half = socket.create_connection(address)
    half.sendall(b"\x16\x03\x01\x02\x00\x01")  # the start of a ClientHello, and nothing more
    try:
        started = time.monotonic()
        assert get(server, "/metrics", client_context(pki)).status == 200
        assert time.monotonic() - started < 1.0
        # Both are dropped at the read timeout (2 s here), handshake or not.
        for sock in (silent, half):
            sock.settimeout(5)
            assert sock.recv(100) == b""
    finally:
        silent.close()
        half.close()


def test_response_headers_from_the_config_are_sent(
        tmp_path: Path, pki: Pki, serve: Callable[..., tuple[HttpServer, WebGate]]) -> None:
    config = write_config(tmp_path / "web.yml", pki)
    data = yaml.safe_load(config.read_text())
    data["http_server_config"] = {"headers": {"Strict-Transport-Security": "max-age=31536000",
                                              "x-content-type-options": "nosniff"}}
    config.write_text(yaml.safe_dump(data))
    server, _ = serve(config)
    response = get(server, "/metrics", client_context(pki))
    assert response.getheader("Strict-Transport-Security") == "max-age=31536000"
    assert response.getheader("X-Content-Type-Options") == "nosniff"


def _touch_later(path: Path) -> None:
    # Some file systems keep mtimes in whole seconds: move it on so the change is seen.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


def test_users_and_certificates_are_reloaded_and_a_broken_file_keeps_the_last_good(
        tmp_path: Path, pki: Pki, serve: Callable[..., tuple[HttpServer, WebGate]]) -> None:
    config = write_config(tmp_path / "web.yml", pki, users={"prometheus": pki.hashed})
    server, gate = serve(config)
    context = client_context(pki)
    new_hash = bcrypt.hashpw(b"rotated", bcrypt.gensalt(4)).decode()
    write_config(config, pki, users={"prometheus": new_hash})
    _touch_later(config)
    wait_until(lambda: get(server, "/metrics", context, ("prometheus", "rotated")).status == 200,
               message="the new password is taken")
    assert get(server, "/metrics", context, ("prometheus", PASSWORD)).status == 401

    # A broken file: logged, and the last good configuration stays.
    config.write_text("tls_server_config: {cert_file: missing.crt, key_file: missing.key}\n")
    _touch_later(config)
    wait_until(lambda: (get(server, "/metrics", context, ("prometheus", "rotated")), gate.failed_reloads)[1] >= 1,
               message="the refused reload")
    assert get(server, "/metrics", context, ("prometheus", "rotated")).status == 200

    # A rotated server certificate (as cert-manager does): new connections get it, without a restart.
    rotated = pki.ca.issue("server-rotated", True)
    # (The same CA and names: the other tests of this module take the rotated certificate as well.)
    pki.server.cert.write_bytes(rotated.cert.read_bytes())
    pki.server.key.write_bytes(rotated.key.read_bytes())
    write_config(config, pki, users={"prometheus": new_hash})
    _touch_later(config)
    _touch_later(pki.server.cert)

    def serial() -> int:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            return x509.load_der_x509_certificate(der).serial_number
    wait_until(lambda: serial() == rotated.serial, message="the rotated certificate served")


@pytest.mark.parametrize(("content", "named"), [
    ("tls_server_config: {cert_file: server.crt}\n", "tls_server_config.key_file"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, min_version: TLS9}\n",
     "tls_server_config.min_version"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, client_auth_type: RequestClientCert}\n",
     "tls_server_config.client_auth_type"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
     "client_auth_type: RequireAndVerifyClientCert}\n", "tls_server_config.client_ca_file"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, cipher_suites: [TLS_BOGUS]}\n",
     "tls_server_config.cipher_suites"),
    ("tls_server_config: {cert_file: server.crt, key_file: server.key, curve_preferences: [X25519]}\n",
     "tls_server_config.curve_preferences"),
    ("tls_server_config: {cert_file: client-ca.crt, key_file: server.key}\n", "tls_server_config.cert_file"),
    ("basic_auth_users: {prometheus: plaintext}\n", "basic_auth_users.prometheus"),
    ("http_server_config: {headers: {Content-Type: text/html}}\n", "http_server_config.headers.Content-Type"),
    ("tls_config: {}\n", "tls_config"),
    ("tls_server_config: [\n", "line 2, column 1"),
])
def test_an_invalid_file_is_refused_naming_the_file_and_the_key(pki: Pki, content: str, named: str) -> None:
    config = pki.ca.directory / "bad.yml"  # beside the certificates: relative paths resolve there
    config.write_text(content)
    with pytest.raises(ConfigError) as refused:
        load_web_config(config)
    message = str(refused.value)
    assert message.startswith(f"--web.config.file {config}"), message
    assert named in message, message
    assert "plaintext" not in message


def test_run_exits_2_on_an_invalid_web_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "web.yml"
    config.write_text("basic_auth_users: {prometheus: '$2b$12$tooshort'}\n")
    code = main(["run", "--imds-endpoint", "http://127.0.0.1:9", "--listen-address", f"127.0.0.1:{free_port()}",
                 "--state-dir", str(tmp_path / "state"), "--web.config.file", str(config)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--web.config.file {config}: basic_auth_users.prometheus" in err
    assert "Traceback" not in err and "tooshort" not in err


@pytest.mark.slow
def test_a_real_prometheus_scrapes_forewarn_over_tls_with_basic_auth(tmp_path: Path, pki: Pki) -> None:
    prometheus = require_tool("prometheus", "Debian package prometheus")
    config = write_config(tmp_path / "web.yml", pki, users={"prometheus": pki.hashed},
                          client_auth_type="RequireAndVerifyClientCert", client_ca_file=str(pki.client_ca.path))
    port, prom_port = free_port(), free_port()
    forewarn = subprocess.Popen(
        [sys.executable, "-m", "forewarn", "run", "--simulate", "platform-reboot", "--poll-interval", "0.5",
         "--web.listen-address", f"127.0.0.1:{port}", "--web.config.file", str(config),
         "--state-dir", str(tmp_path / "state"), "--sink", "file:" + str(tmp_path / "records.jsonl")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def job(name: str, password: str, client_cert: bool = True) -> dict[str, Any]:
        tls: dict[str, Any] = {"ca_file": str(pki.ca.path), "server_name": "localhost"}
        if client_cert:
            tls.update(cert_file=str(pki.client.cert), key_file=str(pki.client.key))
        return {"job_name": name, "scheme": "https", "tls_config": tls,
                "basic_auth": {"username": "prometheus", "password": password},
                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}

    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [job("forewarn", PASSWORD), job("wrong-password", "nope"),
                           job("no-client-cert", PASSWORD, client_cert=False)]}))
    server = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> dict[str, float]:
            try:
                reply = requests.get(f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": "up"}, timeout=2)
                results = reply.json()["data"]["result"]
            except (requests.RequestException, ValueError, KeyError):
                return {}
            return {r["metric"]["job"]: float(r["value"][1]) for r in results}

        seen = wait_until(lambda: (lambda u: u if len(u) == 3 and u["forewarn"] == 1 else None)(up()),
                          timeout=60, interval=0.5, message="every job scraped once and forewarn up")
        assert seen == {"forewarn": 1.0, "wrong-password": 0.0, "no-client-cert": 0.0}
        targets = requests.get(f"http://127.0.0.1:{prom_port}/api/v1/targets", timeout=5).json()
        errors = {t["labels"]["job"]: t["lastError"] for t in targets["data"]["activeTargets"]}
        assert "401" in errors["wrong-password"], errors
        info = requests.get(f"http://127.0.0.1:{prom_port}/api/v1/query",
                            params={"query": 'azure_scheduled_event_info{job="forewarn"}'}, timeout=5).json()
        assert info["data"]["result"], info
    finally:
        for process in (server, forewarn):
            process.terminate()
            process.wait(20)
