"""Certificates and keys for a TLS deployment with node authentication (tests, demos, small labs).

`make_certificates(DIR, nodes, hosts)` writes, with the `cryptography` package (a Flower
dependency):
    ca.crt, ca.key             a self-signed certificate authority (10 years)
    server.pem, server.key     the SuperLink's certificate, signed by the CA, valid for `hosts`
                               (IP addresses or DNS names the nodes use to reach it)
    node-N, node-N.pub         node N's ECDSA P-384 key pair in OpenSSH format (Flower's node
                               authentication takes NIST-curve keys; register node-N.pub)
A production deployment should use its organisation's CA; the README gives the same steps with
openssl and ssh-keygen.
"""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from pfedkit.flower.deploy import TLSFiles


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _certificate(subject: str, public_key, issuer: str, signing_key, *, ca: bool, hosts: tuple[str, ...] = ()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        names = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def make_certificates(directory: str | Path, nodes: int = 0, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
                      ) -> TLSFiles:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_cert = _certificate("pfedkit CA", ca_key.public_key(), "pfedkit CA", ca_key, ca=True)
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server_cert = _certificate(hosts[0], server_key.public_key(), "pfedkit CA", ca_key, ca=False, hosts=hosts)
    _write_key(directory / "ca.key", ca_key)
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(directory / "server.key", server_key)
    (directory / "server.pem").write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    node_keys = []
    for cid in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        path = directory / f"node-{cid}"
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        path.chmod(0o600)
        Path(f"{path}.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                                      serialization.PublicFormat.OpenSSH))
        node_keys.append(path)
    return TLSFiles(directory / "ca.crt", directory / "server.pem", directory / "server.key", tuple(node_keys))
