"""TLS for the master's port and its clients, with Twisted's TLS (pyOpenSSL).

The master wraps its listening factory (:func:`server_factory`): its
certificate chain and key from ``tls.cert``/``tls.key``, and, when
``tls.client_ca`` is set, a required client certificate signed by that CA
(mutual authentication). Clients connect with :func:`connect`: the master's
certificate must chain to ``tls.ca`` (else the system's trust store) and name
the host connected to (or ``tls.server_hostname``), as a DNS name or an IP
address in the subjectAltName; ``tls.client_cert``/``tls.client_key`` are
presented when set.

Files are read when the master starts or a client connects; a missing or bad
file raises :class:`TLSFileError` naming the file.

Twisted's TCP transport (``twisted.internet.tcp``, for ``startTLS``) and its
reactor (``posixbase``, for ``connectSSL``) import pyOpenSSL, cryptography and
service_identity whenever pyOpenSSL is installed, and tolerate its absence:
about 0.1 s of CPU at every start. A process that will not use TLS imports them
through :func:`import_reactor_without_tls`, which keeps pyOpenSSL out while
they load; TLS is still available to it afterwards, because :func:`connect`
wraps the client's factory in ``TLSMemoryBIOFactory`` itself (what
``connectSSL`` does) and the master listens on :func:`server_factory`, neither
of which needs those two modules' TLS parts.
``tests/wire/test_wire_tls.py::test_tls_after_the_reactor_was_imported_without_pyopenssl``
fails if a Twisted release stops tolerating it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

# twisted.internet.ssl and pyOpenSSL are imported only when TLS is used (see above).
if TYPE_CHECKING:
    from twisted.internet import ssl
    from twisted.protocols.tls import TLSMemoryBIOFactory

from replication.settings import TLSConfig

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


class TLSFileError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names it."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TLSFileError(f"{what} {path}: {e.strerror}") from None


def _certificates(path: str, what: str) -> list[ssl.Certificate]:
    from twisted.internet import ssl

    data = _read(path, what)
    blocks = _PEM_CERT.findall(data)
    if not blocks:
        raise TLSFileError(f"{what} {path}: no PEM certificate in it")
    try:
        return [ssl.Certificate.loadPEM(block) for block in blocks]
    except Exception as e:
        raise TLSFileError(f"{what} {path}: not a usable certificate: {e}") from None


def _private_certificate(cert_path: str, key_path: str, what: str) -> tuple[ssl.PrivateCertificate, list[Any]]:
    """The leaf certificate with its key, and the rest of the chain in the file."""
    from OpenSSL import crypto
    from twisted.internet import ssl

    chain = _certificates(cert_path, f"{what}: certificate")
    key_pem = _read(key_path, f"{what}: key")
    try:
        key = ssl.KeyPair.load(key_pem, crypto.FILETYPE_PEM)
    except Exception:
        raise TLSFileError(f"{what}: key {key_path}: no PEM private key in it") from None
    try:
        leaf = ssl.PrivateCertificate.fromCertificateAndKeyPair(chain[0], key)
    except Exception:
        raise TLSFileError(f"{what}: the key {key_path} does not belong to the certificate {cert_path}") from None
    return leaf, [c.original for c in chain[1:]]


def server_options(tls: TLSConfig) -> ssl.CertificateOptions:
    """The master's TLS settings: its certificate, and client certificates when asked for."""
    from twisted.internet import ssl

    if tls.cert is None or tls.key is None:
        raise TLSFileError("tls.cert and tls.key are both needed for the master to listen with TLS")
    leaf, extra = _private_certificate(tls.cert, tls.key, "tls.cert/tls.key")
    kwargs: dict[str, Any] = {}
    if tls.client_ca is not None:
        # trustRoot makes the server ask for a client certificate and require one.
        kwargs["trustRoot"] = ssl.trustRootFromCertificates(_certificates(tls.client_ca, "tls.client_ca"))
    try:
        return ssl.CertificateOptions(
            privateKey=leaf.privateKey.original,
            certificate=leaf.original,
            extraCertChain=extra or None,
            raiseMinimumTo=ssl.TLSVersion.TLSv1_2,
            **kwargs,
        )
    except Exception as e:
        raise TLSFileError(f"tls.cert/tls.key: the certificate and key do not fit together: {e}") from None


def server_factory(tls: TLSConfig, factory: Any) -> TLSMemoryBIOFactory:
    """``factory`` behind TLS: the master listens on it with ``listenTCP``."""
    from twisted.protocols.tls import TLSMemoryBIOFactory

    return TLSMemoryBIOFactory(cast(Any, server_options(tls)), False, factory)


def client_options(tls: TLSConfig, host: str) -> Any:
    """A client's TLS settings for connecting to ``host``."""
    from twisted.internet import ssl

    hostname = tls.server_hostname or host
    trust: Any = None
    if tls.ca is not None:
        trust = ssl.trustRootFromCertificates(_certificates(tls.ca, "tls.ca"))
    client_cert = None
    if tls.client_cert is not None or tls.client_key is not None:
        if tls.client_cert is None or tls.client_key is None:
            raise TLSFileError("tls.client_cert and tls.client_key go together")
        client_cert, _ = _private_certificate(tls.client_cert, tls.client_key, "tls.client_cert/tls.client_key")
    return ssl.optionsForClientTLS(hostname, trustRoot=trust, clientCertificate=client_cert)


def check_files(tls: TLSConfig) -> None:
    """Load every file the settings name, as the master and the clients will; raises TLSFileError."""
    if tls.server_enabled:
        server_options(tls)
    elif tls.client_ca is not None:
        _certificates(tls.client_ca, "tls.client_ca")
    if tls.ca is not None:
        _certificates(tls.ca, "tls.ca")
    if tls.client_cert is not None and tls.client_key is not None:
        _private_certificate(tls.client_cert, tls.client_key, "tls.client_cert/tls.client_key")


def connect(reactor: Any, host: str, port: int, factory: Any, tls: TLSConfig | None) -> Any:
    """``connectTCP``; TLS over it when the configuration turns TLS on for clients.

    With TLS, the factory is wrapped as ``reactor.connectSSL`` does it, which
    also works where the reactor was imported without pyOpenSSL.
    """
    if tls is None or not tls.client_enabled:
        return reactor.connectTCP(host, port, factory)
    from twisted.protocols.tls import TLSMemoryBIOFactory

    return reactor.connectTCP(host, port, TLSMemoryBIOFactory(client_options(tls, host), True, factory))


class _KeepOut:
    """A meta-path finder that refuses pyOpenSSL's modules (as if it were not installed)."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: Any = None) -> ModuleSpec | None:
        if name == "OpenSSL" or name.startswith("OpenSSL."):
            raise ImportError(f"{name} is kept out while Twisted's reactor is imported", name=name)
        return None


def import_reactor_without_tls() -> bool:
    """Import (install) Twisted's default reactor and TCP transport without pyOpenSSL.

    For a process that will not use TLS: it saves about 0.1 s of CPU at its
    start (see the module's text). True if pyOpenSSL stayed out; False if it
    was too late (already imported, or the reactor or TCP transport were).
    Importing pyOpenSSL afterwards works as usual.
    """
    if any(m in sys.modules for m in ("OpenSSL", "twisted.internet.tcp", "twisted.internet.reactor")):
        return "OpenSSL" not in sys.modules
    finder = _KeepOut()
    sys.meta_path.insert(0, finder)
    try:
        import twisted.internet.tcp  # noqa: F401
        from twisted.internet import reactor  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
    return "OpenSSL" not in sys.modules
