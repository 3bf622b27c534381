"""A batch (rows sharing one token) is bounded where it is written and where it is held.

A client holds a batch whole until its last line, so a master that sends
``batch`` lines without end could grow a worker's memory without bound.
Writers refuse a batch longer than ``storage.limits.MAX_BATCH_ROWS`` (nothing
committed, one line naming it), so no stored batch is ever longer; a client
that is sent a longer one closes the connection saying so, holding nothing of it.
"""

from __future__ import annotations

import subprocess

import orjson
import pytest

from replication.streams import EVENTS
from storage.limits import MAX_BATCH_ROWS
from storage.schema import RowError
from storage.store import open_store
from tests.conftest import _env, run_tickline, tickline_command
from tests.ops.helpers import FakeMaster

ROW = ["$e", "!room", "m.room.message", None, None]


def _rows(n: int) -> list[list]:
    return [[f"$e{i}", "!room", "m.room.message", None, None] for i in range(n)]


def test_a_batch_over_the_bound_is_refused_and_commits_nothing(db_url) -> None:
    store = open_store(db_url)
    store.register_stream(EVENTS)
    try:
        with pytest.raises(RowError, match=f"over the limit of {MAX_BATCH_ROWS} rows per batch"):
            store.append("events", _rows(MAX_BATCH_ROWS + 1), "w", batch=True)
        assert store.read_rows("events", 0, 10**9, 10) == []
        # At the bound it is one token.
        tokens = store.append("events", _rows(MAX_BATCH_ROWS), "w", batch=True)
        assert len(set(tokens)) == 1 and len(tokens) == MAX_BATCH_ROWS
    finally:
        store.close()


def test_batch_appends_of_one_transaction_count_together(db_url) -> None:
    # The batch appends of one transaction share its token while nothing else of the stream is
    # allocated between them (docs/time.md, "Batches appended in steps").
    store = open_store(db_url)
    store.register_stream(EVENTS)
    try:
        with (
            pytest.raises(RowError, match="100001 rows of one transaction's batch appends"),
            store.writing("events", "w") as txn,
        ):
            txn.append(_rows(MAX_BATCH_ROWS // 2), batch=True)
            txn.append(_rows(MAX_BATCH_ROWS // 2 + 1), batch=True)
        assert store.read_rows("events", 0, 10**9, 10) == []
    finally:
        store.close()


def test_write_batch_over_the_bound_is_one_line_exit_2(db_url) -> None:
    stdin = b"\n".join(orjson.dumps(row) for row in _rows(MAX_BATCH_ROWS + 1)) + b"\n"
    result = run_tickline("write", "--database", db_url, "--batch", "events", "-", input=stdin)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert f"over the limit of {MAX_BATCH_ROWS} rows per batch" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    # Without --batch the same input is one transaction of single-row tokens.
    plain = run_tickline("write", "--database", db_url, "events", "-", input=stdin)
    assert plain.returncode == 0, plain.stderr
    assert len(plain.stdout.split()) == MAX_BATCH_ROWS + 1


@pytest.mark.parametrize("interleaved", [False, True], ids=["one-run", "line-by-line"])
def test_a_client_sent_an_endless_batch_closes_saying_so(interleaved) -> None:
    fake = FakeMaster(timeout=30)
    try:
        streams = ["events", "caches"] if interleaved else ["events"]
        tail = run_tickline_async(fake.address, streams)
        conn = fake.accept()
        fake.handshake(conn, streams)
        line = b"RDATA events m batch " + orjson.dumps(ROW) + b"\n"
        if interleaved:
            # Lines of two streams in one read are taken one by one (not as a run).
            other = b"RDATA caches m batch " + orjson.dumps(["c", None, 1]) + b"\n"
            line += other
        block = line * 1000
        sent = 0
        try:
            while sent <= MAX_BATCH_ROWS:
                conn.sock.sendall(block)
                sent += 1000
        except OSError:
            pass  # the client closed: what is asserted below
        out, err = tail.communicate(timeout=60)
        assert tail.returncode == 1, err
        assert out == b""  # nothing of the batch was applied
        assert b"longer than 100000 rows" in err and b"Traceback" not in err
    finally:
        fake.close()


def run_tickline_async(address: str, streams: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [*tickline_command(), "tail", "--master", address, "--from", "0", *streams],
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
