"""SeaweedFS's own security settings, so that no path into the store takes unsigned reads or writes.

A ``weed server`` runs a master, a volume server, a filer and the S3 gateway, each on an HTTP port, a gRPC port
(HTTP port + 10000) and local sockets. Only the S3 gateway checks signatures; left alone, the others serve and
take objects from anyone who can reach them. What closes each:

- master and filer HTTP: off (``-disableHttp``, in ``WEED_FLAGS``). The S3 gateway reaches the filer over gRPC,
  and nothing needs the master's HTTP, which would hand anyone a write token (``/dir/assign``) or take an upload
  itself (``/submit``).
- volume HTTP (the stored chunks): JWTs signed with ``jwt.signing`` for writes and ``jwt.signing.read`` for reads;
  the master and filer mint them for the gateway. The filer's keys are set too, should its HTTP be turned on.
- gRPC, on every component's port and socket: mutual TLS under a private CA, so a client without a certificate
  from it is refused at the handshake (the S3 gateway's own gRPC would otherwise let anyone replace its
  identities, and the filer's list and write any file).

``write_security(directory)`` writes ``security.toml`` (read by weed from its working directory, or from
``/etc/seaweedfs``) with fresh random JWT keys, and the CA, certificate and key it names. ``S3Server`` calls it for
the demo and the tests; ``python -m auk_worker.service.ops.seaweed_security /etc/seaweedfs`` is docker-compose's
``seaweedfs-security`` service, run once before SeaweedFS starts (an existing ``security.toml`` is kept).
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import sys
from pathlib import Path

WEED_FLAGS = ("-disableHttp",)  # master and filer HTTP off; with security.toml, no unsigned path is left
COMMON_NAME = "auk-seaweedfs"  # the one certificate every component presents, to servers and as a client
COMPONENTS = ("master", "volume", "filer", "s3")
VALID_DAYS = 3650


def _certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A private CA and one certificate signed by it for every component (servers and clients alike: SeaweedFS
    checks the chain and, here, the common name, not host names). Returns (ca.pem, node.pem, node.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{COMMON_NAME}-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(COMMON_NAME), x509.DNSName("seaweedfs"), x509.DNSName("localhost"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]  # fmt: skip
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, COMMON_NAME)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # fmt: skip
    paths = directory / "ca.pem", directory / "node.pem", directory / "node.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].touch(mode=0o600)
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return paths


def write_security(directory: Path) -> Path:
    """Write ``security.toml`` and the certificates it names into ``directory``; returns the toml's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca, cert, key = _certificates(directory)
    lines = []
    for section in ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read"):
        lines += [f"[{section}]", f'key = "{secrets.token_urlsafe(32)}"', "expires_after_seconds = 10", ""]
    lines += ["[access]", "ui = false", "", "[filer.expose_directory_metadata]", "enabled = false", ""]
    lines += ["[grpc]", f'ca = "{ca}"', ""]
    for component in (*COMPONENTS, "client"):
        lines += [f"[grpc.{component}]", f'cert = "{cert}"', f'key = "{key}"']
        if component != "client":
            lines.append(f'allowed_commonNames = "{COMMON_NAME}"')
        lines.append("")
    toml = directory / "security.toml"
    toml.touch(mode=0o600)
    toml.write_text("\n".join(lines))
    return toml


def main(argv: list[str] | None = None) -> int:
    """``python -m auk_worker.service.ops.seaweed_security DIR``: write DIR/security.toml once (kept if present)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m auk_worker.service.ops.seaweed_security DIRECTORY", file=sys.stderr)
        return 2
    toml = Path(args[0]) / "security.toml"
    if toml.exists():
        print(f"{toml} exists; kept")
        return 0
    print(f"wrote {write_security(Path(args[0]))} (JWT keys, gRPC CA and certificate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
