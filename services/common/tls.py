"""TLS for every server and client: the server's certificate is re-read when its files change, so a renewed
certificate (cert-manager, a rotated Secret) is served from the next connection on without a restart."""

import logging
from pathlib import Path

import grpc

from services.common.auth import file_stamp
from services.common.config import TlsConfig
from services.common.errors import StartupError

log = logging.getLogger(__name__)


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


def _stamp(tls: TlsConfig) -> tuple:
    return tuple(file_stamp(p) for p in (tls.cert_file, tls.key_file, tls.ca_file) if p is not None)


def _certificate(tls: TlsConfig) -> grpc.ServerCertificateConfiguration:
    pair = [(_read(tls.key_file), _read(tls.cert_file))]
    return grpc.ssl_server_certificate_configuration(pair, root_certificates=_read(tls.ca_file))


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """TLS server credentials; mutual TLS (client certificates signed by the CA required) when `ca_file` is set."""
    try:
        first, stamp = _certificate(tls), _stamp(tls)
    except (OSError, ValueError) as e:
        raise StartupError(f"cannot read the TLS files (--tls-cert-file, --tls-key-file, --tls-ca-file): {e}") from None
    state = {"stamp": stamp}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before each new connection's handshake: a new configuration when a file changed."""
        try:
            stamp = _stamp(tls)
            if stamp == state["stamp"]:
                return None
            renewed = _certificate(tls)
        except (OSError, ValueError) as e:  # a file mid-rewrite: keep serving the current certificate
            log.warning("TLS files changed but cannot be read yet (%s); serving the previous certificate", e)
            return None
        state["stamp"] = stamp
        log.info("TLS certificate re-read from %s", tls.cert_file)
        return renewed

    return grpc.dynamic_ssl_server_credentials(first, fetch, require_client_authentication=tls.ca_file is not None)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """TLS client credentials: servers checked against `ca_file` (else the system's roots), this service's own
    certificate presented (used by servers that require mutual TLS)."""
    try:
        return grpc.ssl_channel_credentials(_read(tls.ca_file), _read(tls.key_file), _read(tls.cert_file))
    except OSError as e:
        raise StartupError(f"cannot read the TLS files (--tls-cert-file, --tls-key-file, --tls-ca-file): {e}") from None
