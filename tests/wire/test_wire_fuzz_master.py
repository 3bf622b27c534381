"""Property-based tests of a master on a real socket (issue 10, item 7, the master's half).

Hypothesis sends random bytes, truncated and huge lines and floods to one
master subprocess; after every example the master must be alive and serve a
new client, and at the end its memory and log must have stayed bounded.
Example counts are modest (two shared cores); the whole module runs in
well under a minute.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MasterProcess
from tests.wire.hostile import rss_kib

MAX_LINE = 4096
CONFIG = f"protocol:\n  max_line_bytes: {MAX_LINE}\n"

COMMAND_LINES = [
    b"PING 1",
    b"NAME fuzz",
    b"REPLICATE",
    b"REPLICATE events 0",
    b"OPTIONS ts live",
    b"AUTH x",
    b"USER_SYNC w1 @u:a start 1",
    b"CLEAR_USER_SYNC w1",
    b"FEDERATION_ACK w1 3",
    b"REMOVE_PUSHER app key @u:a",
    b"REMOTE_SERVER_UP example.org",
    b"ERROR oops",
    b'RDATA events w 1 ["x"]',
]

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> Iterator[tuple[MasterProcess, dict[str, int]]]:
    workdir: Path = tmp_path_factory.mktemp("fuzzmaster")
    m = MasterProcess(workdir, CONFIG, (), None, None)
    m.append("events", [["$e", "!r", "t", None, None]] * 3)
    baseline = {"rss": rss_kib(m.pid), "log": len(m.log())}
    yield m, baseline
    m.stop()


def _send(m: MasterProcess, data: bytes) -> None:
    """Send ``data`` on a fresh connection, read what comes back for a moment, and go."""
    sock = socket.create_connection((m.host, m.port), timeout=5)
    try:
        sock.setblocking(True)
        sock.settimeout(2)
        try:
            sock.sendall(data)
        except OSError:
            return  # the master closed it (line too long): fine
        sock.settimeout(0.05)
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            try:
                if not sock.recv(1 << 16):
                    break
            except (TimeoutError, OSError):
                break
    finally:
        sock.close()


def _serves(m: MasterProcess) -> None:
    assert m.alive(), m.log()[-3000:]
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 2")
    assert client.next_command() == "POSITION events master 2 2"
    client.close()


truncated = st.builds(lambda line, cut: line[:cut], st.sampled_from(COMMAND_LINES), st.integers(0, 40))
huge = st.builds(
    lambda word, size, newline: word + b" " + b"y" * size + (b"\n" if newline else b""),
    st.sampled_from([b"NAME", b"ERROR", b"RDATA events w 1", b"FEDERATION_ACK", b"X"]),
    st.integers(MAX_LINE - 8, 3 * MAX_LINE),
    st.booleans(),
)
garbage = st.binary(min_size=1, max_size=2000)
flood = st.builds(
    lambda line, count: (line + b"\n") * count,
    st.sampled_from([*COMMAND_LINES, b"BOGUS", b"\xff\xfe", b"PING x", b"NAME " + b"n" * 300]),
    st.integers(100, 5000),
)
mixed = st.lists(
    st.one_of(st.sampled_from(COMMAND_LINES).map(lambda b: b + b"\n"), truncated, garbage),
    min_size=1,
    max_size=30,
).map(b"".join)


@SETTINGS
@given(data=st.one_of(garbage, truncated, huge, flood, mixed))
def test_master_survives_hostile_bytes_and_keeps_serving(fuzzed, data: bytes) -> None:
    m, _ = fuzzed
    _send(m, data)
    _serves(m)


def test_master_memory_and_log_stayed_bounded(fuzzed) -> None:
    """Runs after the property above (same module-scoped master)."""
    m, baseline = fuzzed
    # A last flood of 4 MB of bad lines on one connection.
    _send(m, b"BOGUS LINE\n" * 400_000)
    _serves(m)
    grown_rss = rss_kib(m.pid) - baseline["rss"]
    grown_log = len(m.log()) - baseline["log"]
    print(f"fuzzed master: RSS +{grown_rss} KiB, log +{grown_log} bytes")
    assert grown_rss < 40_000, f"the master's RSS grew by {grown_rss} KiB"
    assert grown_log < 400_000, f"the master's log grew by {grown_log} bytes"
    assert "Traceback" not in m.log()
