"""Throwaway certificate authorities, server and client certificates for the TLS tests (``cryptography``)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class ServerFiles:
    """PEM files: the CA certificate (clients verify with it), the server's certificate and key."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClientFiles:
    """PEM files: the client CA's certificate (servers verify client certificates with it:
    ``env-server --tls-client-ca``), a client's certificate and key (``--tls-client-cert/-key``)."""

    ca: Path
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _make_ca(ca_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    now = _now()
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert


def _issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    alt_names: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new key, and a certificate for it that ``ca_cert`` signs, for ``usage`` (server or client auth)."""
    now = _now()
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    cert = (
        builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _alt_names(names: tuple[str, ...]) -> list[x509.GeneralName]:
    """``names`` as a certificate's subject alternative names: IP addresses as such, the rest as DNS names."""
    alt_names: list[x509.GeneralName] = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    return alt_names


def _write(
    files: ServerFiles | ClientFiles, ca_cert: x509.Certificate, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> None:
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(_pem_key(key))
    files.key.chmod(0o600)


def make_server_certs(
    folder: Path, names: tuple[str, ...] = ("localhost", "127.0.0.1"), ca_name: str = "test CA"
) -> ServerFiles:
    """A new CA, and a server certificate it signs for ``names`` (DNS names or IP addresses), in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _make_ca(ca_name)
    alt_names = _alt_names(names)
    key, cert = _issue(ca_key, ca_cert, names[0], alt_names, ExtendedKeyUsageOID.SERVER_AUTH)
    files = ServerFiles(ca=folder / "ca.crt", cert=folder / "server.crt", key=folder / "server.key")
    _write(files, ca_cert, cert, key)
    return files


def make_client_certs(
    folder: Path, name: str = "learner", ca_name: str = "test client CA", others: tuple[str, ...] = ()
) -> ClientFiles:
    """A new CA for clients, and a client certificate (extended key usage: client auth) it signs for
    ``name``, in ``folder``: ``client-ca.crt``, ``client.crt``, ``client.key``; and one for each of
    ``others``, signed by the same CA: ``<other>.crt``, ``<other>.key``."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _make_ca(ca_name)
    key, cert = _issue(ca_key, ca_cert, name, [], ExtendedKeyUsageOID.CLIENT_AUTH)
    files = ClientFiles(ca=folder / "client-ca.crt", cert=folder / "client.crt", key=folder / "client.key")
    _write(files, ca_cert, cert, key)
    for other in others:
        key, cert = _issue(ca_key, ca_cert, other, [], ExtendedKeyUsageOID.CLIENT_AUTH)
        _write(ClientFiles(ca=files.ca, cert=folder / f"{other}.crt", key=folder / f"{other}.key"), ca_cert, cert, key)
    return files


def make_self_signed_cert(folder: Path, names: tuple[str, ...] = ("localhost",)) -> ServerFiles:
    """A self-signed server certificate for ``names`` and its key, in ``folder``, as the README's openssl
    line makes one: the certificate is its own CA (``ca`` and ``cert`` are the same file)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = _now()
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names = _alt_names(names)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(_name(names[0]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)  # (as openssl req -x509)
        .sign(key, hashes.SHA256())
    )
    path = folder / "server.crt"
    files = ServerFiles(ca=path, cert=path, key=folder / "server.key")
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(_pem_key(key))
    files.key.chmod(0o600)
    return files
