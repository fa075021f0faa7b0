"""Real X.509 certificates for the TLS tests: a CA, a certificate it signs for localhost / 127.0.0.1 (servers and
clients alike), and a second CA with a certificate of its own (a stranger's)."""

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Pair:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key) -> Pair:
    pair = Pair(folder / f"{stem}.crt", folder / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pair.key.write_bytes(pem)
    return pair


def _certificate(subject: str, key, issuer: str, issuer_key, ca: bool, days: int = 1) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_ca(folder: Path, stem: str = "ca") -> tuple[Pair, object]:
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    return _write(folder, stem, _certificate(f"{stem} test CA", key, f"{stem} test CA", key, ca=True), key), key


def make_leaf(folder: Path, stem: str, ca: Pair, ca_key, days: int = 1) -> Pair:
    """A certificate for localhost and 127.0.0.1 signed by `ca`."""
    key = ec.generate_private_key(ec.SECP256R1())
    issuer = x509.load_pem_x509_certificate(ca.cert.read_bytes()).subject.rfc4514_string().removeprefix("CN=")
    return _write(folder, stem, _certificate(stem, key, issuer, ca_key, ca=False, days=days), key)
