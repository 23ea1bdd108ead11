"""/metrics latency over TLS with basic auth (--web.config.file), 100 events, beside plain HTTP.

`forewarn run` as deployed, against the in-process simulator filled with 100 events; a test CA and a
bcrypt hash of cost 12 (a realistic one: the cache is what keeps scrapes cheap) made here. Measured:
- kept alive: sequential scrapes on one connection, as Prometheus scrapes (its connections are reused);
- new connection: a TLS handshake for every scrape (the worst case: a scraper that does not keep alive);
- plain: the same scrapes without a web configuration, for comparison.

    python bench/tls.py [--quick]

Results are printed and written to bench/results/tls.json. Goal: kept-alive p99 at most 10 ms.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import bcrypt
import requests
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from forewarn.simulator import Simulator, SimulatorServer, load_scenario

from common import Collector, header, summary_ms, write_results

EVENTS = 100
PASSWORD = "bench-password"


def make_pki(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "forewarn")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.crt", directory / "server.crt", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def fill(sim: Simulator, events: int) -> None:
    for i in range(events):
        sim.inject({"id": f"TLS-{i:04d}", "type": random.choice(["Reboot", "Redeploy", "Freeze"]), "notice": 900,
                    "description": "Host server is undergoing maintenance."})


def wait_for_events(get: Any, url: str, events: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if get(url).text.count("azure_scheduled_event_info{") == events:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{events} events not visible at {url}")


def scrapes(url: str, count: int, keep_alive: bool, **options: Any) -> dict[str, Any]:
    session = requests.Session()
    latencies = []
    for _ in range(count):
        if not keep_alive:
            session.close()
            session = requests.Session()
        started = time.perf_counter()
        response = session.get(url, **options)
        response.raise_for_status()
        latencies.append(time.perf_counter() - started)
    session.close()
    return summary_ms(latencies) | {"bytes": len(response.content)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer scrapes (a smoke run)")
    args = parser.parse_args()
    count = 200 if args.quick else 2000
    results: dict[str, Any] = {"header": header(), "events": EVENTS, "bcrypt_cost": 12}
    sim = Simulator(load_scenario("quiet"))
    server = SimulatorServer(sim).serve_in_background()
    fill(sim, EVENTS)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        ca, cert, key = make_pki(directory)
        config = directory / "web.yml"
        config.write_text(yaml.safe_dump({
            "tls_server_config": {"cert_file": str(cert), "key_file": str(key)},
            "basic_auth_users": {"prometheus": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(12)).decode()}}))
        secured = Collector(server.url, directory / "state-tls", 1.0, sinks=[f"file:{tmp}/tls.jsonl"],
                            extra=["--web.config.file", str(config)], wait=False)
        plain = Collector(server.url, directory / "state-plain", 1.0, sinks=[f"file:{tmp}/plain.jsonl"])
        try:
            https = f"https://127.0.0.1:{secured.port}/metrics"
            options: dict[str, Any] = {"verify": str(ca), "auth": ("prometheus", PASSWORD), "timeout": 10}
            wait_for_events(lambda url: requests.get(url, **options), https, EVENTS)
            wait_for_events(lambda url: requests.get(url, timeout=10), plain.url + "/metrics", EVENTS)
            results["tls_basic_auth_kept_alive"] = scrapes(https, count, True, **options)
            print(f"TLS + basic auth, kept alive: {results['tls_basic_auth_kept_alive']}", flush=True)
            results["tls_basic_auth_new_connection"] = scrapes(https, count // 4, False, **options)
            print(f"TLS + basic auth, new connection each: {results['tls_basic_auth_new_connection']}", flush=True)
            results["plain_kept_alive"] = scrapes(plain.url + "/metrics", count, True, timeout=10)
            print(f"plain HTTP, kept alive: {results['plain_kept_alive']}", flush=True)
        finally:
            secured.stop()
            plain.stop()
            server.stop()
    results["goal_met"] = results["tls_basic_auth_kept_alive"]["p99_ms"] <= 10.0
    write_results("tls", results)


if __name__ == "__main__":
    main()
