"""TLS on real sockets (issue 10, item 6), with certificates made by /usr/bin/openssl at test time.

A CA signs a server certificate for 127.0.0.1 (an IP subjectAltName) and a
client certificate; a second CA stands for one the client does not trust.
"""

from __future__ import annotations

import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_tickline, sqlite_url
from tests.integration.procs import wait_for
from tests.ops.helpers import sample, scrape

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
EVENT_ROW = ["$e", "!room", "m.type", None, None]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str, cn: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    if not Path(OPENSSL).exists():
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "otherca")
    _leaf(d, "server", "ca", "127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "ca", "worker1", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "rogue", "otherca", "rogue", "extendedKeyUsage=clientAuth\n")
    return d


def master_tls(certs: Path, mutual: bool = True) -> str:
    text = f"tls:\n  cert: {certs / 'server.pem'}\n  key: {certs / 'server.key'}\n"
    if mutual:
        text += f"  client_ca: {certs / 'ca.pem'}\n"
    return text


def client_config(tmp_path: Path, name: str, **tls: str | Path) -> str:
    path = tmp_path / f"{name}.yaml"
    lines = ["tls:"] + [f"  {k}: {v}" for k, v in tls.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def good_client(tmp_path: Path, certs: Path) -> str:
    return client_config(
        tmp_path,
        "good",
        ca=certs / "ca.pem",
        client_cert=certs / "client.pem",
        client_key=certs / "client.key",
    )


def tail(config: str, m, *args: str, timeout: float = 30):
    return run_tickline("tail", "-c", config, "--master", m.address, *args, timeout=timeout)


def test_tail_over_mutual_tls_receives_rows(master, certs, tmp_path) -> None:
    m = master(master_tls(certs))
    m.append("events", [EVENT_ROW, EVENT_ROW])
    result = tail(good_client(tmp_path, certs), m, "--from", "0", "--count", "2", "events")
    assert result.returncode == 0, result.stderr
    assert [line.count('"token":') for line in result.stdout.splitlines()] == [1, 1]
    assert '"token":2' in result.stdout
    assert "(TLS)" in m.log()


def test_worker_over_tls_applies_rows(master, certs, tmp_path, spawn) -> None:
    m = master(master_tls(certs))
    m.append("events", [EVENT_ROW] * 3)
    db = tmp_path / "w.db"
    config = tmp_path / "worker.yaml"
    config.write_text(
        f"worker:\n  name: w1\n  master: {m.address}\n  database: {sqlite_url(db)}\n  replicate: [events]\n"
        f"tls:\n  ca: {certs / 'ca.pem'}\n  client_cert: {certs / 'client.pem'}\n  client_key: {certs / 'client.key'}\n"
    )
    spawn("worker", "-c", str(config))

    def applied() -> int:
        if not db.exists():
            return 0
        try:
            with sqlite3.connect(db) as conn:
                return conn.execute("select count(*) from replicated_events").fetchone()[0]
        except sqlite3.Error:
            return 0

    wait_for(lambda: applied() == 3, 30, "the worker to apply 3 rows over TLS")
    m.append("events", [EVENT_ROW])
    wait_for(lambda: applied() == 4, 30, "a live row over TLS")


# A process that imported Twisted's reactor without pyOpenSSL (as `tickline worker` does when
# TLS is not configured: replication.tls.import_reactor_without_tls) can still connect with TLS.
_TLS_AFTER_KEEPING_OPENSSL_OUT = """
import sys
from replication.settings import TLSConfig
from replication.tls import connect, import_reactor_without_tls

assert import_reactor_without_tls(), "pyOpenSSL came in with Twisted's reactor"
assert "OpenSSL" not in sys.modules and "twisted.internet.tcp" in sys.modules
from twisted.internet import protocol, reactor
from twisted.protocols.basic import LineOnlyReceiver

firsts = []

class First(LineOnlyReceiver):
    delimiter = b"\\n"

    def lineReceived(self, line):
        firsts.append(line.split()[0].decode())
        if firsts[-1] == "SERVER":
            self.transport.loseConnection()

    def connectionLost(self, reason):
        reactor.stop()

class Factory(protocol.ClientFactory):
    protocol = First

    def clientConnectionFailed(self, connector, reason):
        print("failed:", reason.getErrorMessage())
        reactor.stop()

host, port = sys.argv[1].rsplit(":", 1)
tls = TLSConfig(ca=sys.argv[2], client_cert=sys.argv[3], client_key=sys.argv[4])
connect(reactor, host, int(port), Factory(), tls)
reactor.callLater(20, reactor.stop)
reactor.run()
print(" ".join(firsts), "OpenSSL" in sys.modules)
"""


def test_tls_after_the_reactor_was_imported_without_pyopenssl(master, certs) -> None:
    # Fails if a Twisted release no longer tolerates pyOpenSSL's absence at import (the worker's
    # start relies on it), or if TLS then no longer works in that process.
    m = master(master_tls(certs))
    out = subprocess.run(
        [
            sys.executable, "-c", _TLS_AFTER_KEEPING_OPENSSL_OUT, m.address,
            str(certs / "ca.pem"), str(certs / "client.pem"), str(certs / "client.key"),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["SERVER", "True"], out.stdout  # the master's SERVER, read over TLS
    assert "(TLS)" in m.log()


def test_plaintext_client_to_a_tls_port_fails_cleanly(master, certs, tmp_path) -> None:
    m = master(master_tls(certs, mutual=False))
    sock = socket.create_connection((m.host, m.port), timeout=5)
    sock.sendall(b"PING 1\nREPLICATE\n")
    received = b""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        received += chunk
    sock.close()
    assert b"SERVER" not in received  # nothing in plaintext
    m.wait_for_log("TLS failed")
    # A plaintext tail says what went wrong in one line, no traceback.
    plain = tail(client_config(tmp_path, "plain"), m, "--from", "0", "--count", "1", "events", timeout=20)
    assert plain.returncode == 1
    assert "tickline tail: error:" in plain.stderr and "Traceback" not in plain.stderr
    # The master serves TLS clients as before.
    ok = tail(client_config(tmp_path, "ca", ca=certs / "ca.pem"), m, "--from", "0", "--count", "0", "events")
    assert ok.returncode == 0, ok.stderr
    assert m.alive() and "Traceback" not in m.log()


def test_a_tls_client_to_a_plaintext_port_fails_cleanly(master, certs, tmp_path) -> None:
    m = master()
    result = tail(client_config(tmp_path, "ca", ca=certs / "ca.pem"), m, "--from", "0", "--count", "1", "events")
    assert result.returncode == 1 and result.stdout == ""
    assert "tickline tail: error:" in result.stderr and "Traceback" not in result.stderr
    m.wait_for_log("closing: TLS handshake on a plaintext port: this master does not use TLS")
    plain = m.connect()
    plain.handshake()
    plain.send("REPLICATE caches 0")
    assert plain.next_command() == "POSITION caches master 0 0"


def test_a_client_without_the_required_certificate_is_refused(master, certs, tmp_path) -> None:
    m = master(master_tls(certs))
    m.append("events", [EVENT_ROW])
    no_cert = tail(client_config(tmp_path, "nocert", ca=certs / "ca.pem"), m, "--from", "0", "--count", "1", "events")
    assert no_cert.returncode == 1 and no_cert.stdout == ""
    assert "tickline tail: error:" in no_cert.stderr and "Traceback" not in no_cert.stderr
    rogue = client_config(
        tmp_path, "rogue", ca=certs / "ca.pem", client_cert=certs / "rogue.pem", client_key=certs / "rogue.key"
    )
    refused = tail(rogue, m, "--from", "0", "--count", "1", "events")
    assert refused.returncode == 1 and refused.stdout == ""
    m.wait_for_log("TLS failed")
    assert tail(good_client(tmp_path, certs), m, "--from", "0", "--count", "1", "events").returncode == 0


def test_a_client_that_does_not_trust_the_master_refuses(master, certs, tmp_path) -> None:
    m = master(master_tls(certs, mutual=False))
    m.append("events", [EVENT_ROW])
    result = tail(
        client_config(tmp_path, "other", ca=certs / "otherca.pem"), m, "--from", "0", "--count", "1", "events"
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "certificate verify failed" in result.stderr, result.stderr
    # The name checked must be in the certificate: 127.0.0.1 is, another name is not.
    wrong = client_config(tmp_path, "wrong", ca=certs / "ca.pem", server_hostname="wrong.example.org")
    result = tail(wrong, m, "--from", "0", "--count", "1", "events")
    assert result.returncode == 1 and result.stdout == ""


def test_openssl_s_client_is_the_netcat_of_tls(master, certs, unused_port) -> None:
    m = master(master_tls(certs) + f"metrics_listen: 127.0.0.1:{unused_port}\n")
    m.append("events", [EVENT_ROW])
    proc = subprocess.Popen(
        [
            OPENSSL, "s_client", "-connect", m.address, "-quiet", "-verify_return_error",
            "-CAfile", str(certs / "ca.pem"), "-cert", str(certs / "client.pem"), "-key", str(certs / "client.key"),
        ],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"PING 1\nREPLICATE events 0\n")
        proc.stdin.flush()
        lines: list[str] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(line.startswith("RDATA") for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.decode().rstrip("\n"))
        assert lines[0] == "SERVER tickline", lines
        assert "POSITION events master 0 0" in lines
        assert any(line.startswith("RDATA events writer 1 ") for line in lines), lines
        # /metrics reads a TLS connection like any other (the PING gave a clock offset).
        text = scrape(unused_port)
        assert sample(text, "tickline_connections") == 1
        assert sample(text, "tickline_clock_offset_seconds") is not None
    finally:
        proc.kill()
        proc.communicate(timeout=5)


def test_bad_tls_files_are_one_line_errors(tmp_path, certs) -> None:
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"tls:\n  cert: {tmp_path / 'nope.pem'}\n  key: {certs / 'server.key'}\n")
    result = run_tickline("check-config", "-c", str(missing))
    assert result.returncode == 2 and "tls.cert: cannot read" in result.stderr
    half = tmp_path / "half.yaml"
    half.write_text(f"tls:\n  cert: {certs / 'server.pem'}\n")
    result = run_tickline("check-config", "-c", str(half))
    assert result.returncode == 2 and "tls.cert and tls.key must be given together" in result.stderr
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"tls:\n  ca: {garbage}\n")
    result = run_tickline("tail", "-c", str(bad), "--master", "127.0.0.1:1", "events")
    assert result.returncode == 2 and "no PEM certificate" in result.stderr and "Traceback" not in result.stderr
    # A key that does not belong to the certificate, for the master and check-config alike.
    mismatched = tmp_path / "mismatched.yaml"
    mismatched.write_text(f"tls:\n  cert: {certs / 'server.pem'}\n  key: {certs / 'client.key'}\n")
    for command in (["check-config"], ["master", "--listen", "127.0.0.1:0"]):
        result = run_tickline(*command, "-c", str(mismatched))
        assert result.returncode == 2, result.stderr
        assert "tls.cert/tls.key" in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
