"""A small certificate authority for tests: a self-signed CA that issues server certificates for loopback
(DNS `localhost`, IP 127.0.0.1 and ::1), as PEM bytes, made with `cryptography` on the spot (EC P-256, valid
for a day). Nothing is written to disk unless a caller writes it.

    ca = Authority("kube-ca")
    cert, key = ca.issue_server("kube-apiserver")
    ca.pem                      # the CA certificate, for a client's trust store (ca.crt, kubeconfig)
    ca.server_context("kube-apiserver")  # an ssl.SSLContext for a server with a certificate of this CA
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1))


class Authority:
    """A self-signed test CA."""

    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.certificate = _validity(
            x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
        ).add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False), critical=True,
        ).add_extension(
            x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False,
        ).sign(self.key, hashes.SHA256())
        self.pem = self.certificate.public_bytes(serialization.Encoding.PEM)

    def issue_server(self, name: str) -> tuple[bytes, bytes]:
        """A server certificate for loopback signed by this CA, and its private key (PKCS#8), as PEM."""
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = _validity(
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        ).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False,
        ).add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False,
        ).add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                         x509.IPAddress(ipaddress.ip_address("::1"))]), critical=False,
        ).sign(self.key, hashes.SHA256())
        return (certificate.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    def server_context(self, name: str) -> ssl.SSLContext:
        """A TLS server context with a fresh certificate of this CA. The ssl module loads a chain from files
        only: they live in a private temporary directory for the moment of loading and are gone after."""
        cert, key = self.issue_server(name)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        with tempfile.TemporaryDirectory(prefix="pki-") as directory:
            cert_path, key_path = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
            with open(cert_path, "wb") as out:
                out.write(cert)
            with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
                out.write(key)
            context.load_cert_chain(cert_path, key_path)
        return context
