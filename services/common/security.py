"""The internal plane's credentials: TLS files for mutual TLS on every gRPC hop, and the cluster
secret (a file, from a Kubernetes Secret) that signs registry entries with HMAC-SHA256.

Pure functions and frozen values, safe from any thread; imports no torch (the gateway uses it).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)
# A shorter secret is a password, not a key: refuse it at start-up rather than sign with it.
MIN_CLUSTER_SECRET_BYTES = 16
TLS_ENV = {"cert": "SPLITSERVE_TLS_CERT", "key": "SPLITSERVE_TLS_KEY", "ca": "SPLITSERVE_TLS_CA",
           "server_name": "SPLITSERVE_TLS_SERVER_NAME"}
CLUSTER_SECRET_ENV = "SPLITSERVE_CLUSTER_SECRET_FILE"


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of one process: its certificate chain and key, and the CA its peers' certificates
    must chain to. All empty: plaintext. `server_name` (clients only): the name a worker's
    certificate must carry, instead of the dialed host; pods dial IPs, a shared certificate names
    the service."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    server_name: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def check(self) -> None:
        """Raises ValueError naming the flag at fault: a half-configured TLS would quietly fall
        back to plaintext, so all three files or none."""
        given = {name: getattr(self, name) for name in ("cert", "key", "ca")}
        if not any(given.values()):
            return
        missing = [f"--tls-{name}" for name, path in given.items() if not path]
        if missing:
            raise ValueError(f"TLS needs --tls-cert, --tls-key and --tls-ca together; "
                             f"missing {', '.join(missing)}")
        for name, path in given.items():
            if not os.path.isfile(path):
                raise ValueError(f"--tls-{name} {path!r} is not a file")
            with open(path, "rb") as f:
                if b"-----BEGIN " not in f.read():
                    raise ValueError(f"--tls-{name} {path!r} is not a PEM file")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA bundle) as bytes."""
        out = []
        for path in (self.cert, self.key, self.ca):
            with open(path, "rb") as f:
                out.append(f.read())
        return out[0], out[1], out[2]

    def describe(self) -> str:
        return f"mtls(ca={self.ca})" if self.enabled else "off"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TLSFiles:
        """What a process started with this environment uses (launchers, tests, profiler)."""
        env = os.environ if env is None else env
        return cls(**{field: env.get(name, "") for field, name in TLS_ENV.items()})


def _server_configuration(tls: TLSFiles):
    cert, key, ca = tls.read()
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class _RenewedCertificates:
    """gRPC asks this at each new connection's handshake (on its own threads): a new
    configuration when one of the files changed, else None (keep the current one). A renewed
    Secret reaches running pods as new files (an atomic swap), so no restart is needed."""

    def __init__(self, tls: TLSFiles) -> None:
        self.tls = tls
        self.stamp = self._stamp()

    def _stamp(self) -> tuple:
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino)
                     for st in (os.stat(p) for p in (self.tls.cert, self.tls.key, self.tls.ca)))

    def __call__(self):
        try:
            stamp = self._stamp()
            if stamp == self.stamp:
                return None
            configuration = _server_configuration(self.tls)
        except OSError:  # a file missing for a moment: keep serving with the current one
            return None
        self.stamp = stamp
        log.info("TLS certificate files changed: new connections get the new ones")
        return configuration


def server_credentials(tls: TLSFiles, *, require_client_cert: bool = True) -> grpc.ServerCredentials:
    """A peer whose certificate does not chain to `tls.ca` fails the handshake; without
    `require_client_cert`, a client may also connect with no certificate at all. The files are
    re-read when they change (a renewed certificate or CA bundle)."""
    return grpc.dynamic_ssl_server_credentials(
        _server_configuration(tls), _RenewedCertificates(tls),
        require_client_authentication=require_client_cert)


def add_port(server, address: str, tls: TLSFiles | None, *,
             require_client_cert: bool = True) -> int:
    """Binds `address` on a grpc (or grpc.aio) server: TLS when configured, never both; returns
    the bound port (0 when it could not bind)."""
    if tls is None or not tls.enabled:
        return server.add_insecure_port(address)
    return server.add_secure_port(
        address, server_credentials(tls, require_client_cert=require_client_cert))


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    cert, key, ca = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def _options(tls: TLSFiles | None, options: Sequence[tuple]) -> list[tuple]:
    options = list(options)
    if tls is not None and tls.enabled and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def aio_channel(address: str, tls: TLSFiles | None, options: Sequence[tuple] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to a worker or gateway: mutual TLS when `tls` is configured."""
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=_options(tls, options))


def sync_channel(address: str, tls: TLSFiles | None, options: Sequence[tuple] = ()) -> grpc.Channel:
    """The blocking grpc twin of aio_channel."""
    if tls is None or not tls.enabled:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=_options(tls, options))


def read_cluster_secret(path: str) -> bytes:
    """The shared secret from its file, surrounding whitespace removed (a Secret written with
    `echo` ends in a newline). Raises ValueError with the flag's name on any problem."""
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"--cluster-secret-file {path!r}: {exc.strerror}") from None
    if len(secret) < MIN_CLUSTER_SECRET_BYTES:
        raise ValueError(f"--cluster-secret-file {path!r} holds {len(secret)} bytes; use at least "
                         f"{MIN_CLUSTER_SECRET_BYTES} random bytes (e.g. `openssl rand -hex 32`)")
    return secret


def hmac_sign(secret: bytes, domain: bytes, message: bytes) -> str:
    """HMAC-SHA256 of `message` under `secret`, separated by `domain` so that a signature made
    for one kind of record never verifies as another."""
    return hmac.new(secret, domain + b"\n" + message, hashlib.sha256).hexdigest()


def hmac_verify(secret: bytes, domain: bytes, message: bytes, signature: object) -> bool:
    """Constant-time comparison; any non-string signature is simply wrong."""
    if not isinstance(signature, str):
        return False
    return hmac.compare_digest(hmac_sign(secret, domain, message), signature)
