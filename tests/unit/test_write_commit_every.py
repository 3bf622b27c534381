"""``tickline write --commit-every N``: the rows in transactions of N rows, each printed once committed.

As a real process on both backends: every transaction is all or nothing; a
failure names how many rows committed before it (their tokens were printed);
rows fed one line at a time with ``--commit-every 1`` are committed as they
come, not when stdin ends; N must be 1 or more.
"""

from __future__ import annotations

import select
import subprocess

import orjson
import pytest

from storage.store import open_store
from tests.conftest import ROOT, _env, run_tickline, tickline_command


def event(n: int) -> bytes:
    return orjson.dumps([f"$e{n}", "!room", "m.room.message", None, None])


def stored(url: str) -> list[tuple[int, str]]:
    store = open_store(url)
    try:
        return [(r[1], r[4]) for r in store.read_rows("events", 0, 10**9, 10**9)]
    finally:
        store.close()


def test_rows_are_written_in_transactions_of_n(db_url) -> None:
    lines = b"".join(event(n) + b"\n" for n in range(2500))
    done = run_tickline("write", "--database", db_url, "--commit-every", "1000", "events", "-", input=lines)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(t) for t in range(1, 2501)]
    assert stored(db_url) == [(n + 1, f"$e{n}") for n in range(2500)]


def test_a_bad_line_stops_its_transaction_and_says_what_committed_before(db_url) -> None:
    lines = b"".join(event(n) + b"\n" for n in range(1500)) + b'["$x", "!r", 7, null, null]\n' + event(9) + b"\n"
    done = run_tickline("write", "--database", db_url, "--commit-every", "1000", "events", "-", input=lines)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "tickline write: error: 1,000 rows committed before this, their tokens printed; then: "
        "stdin line 1501: stream 'events': column 'type' expects text, got int 7"
    )
    assert done.stdout.split() == [str(t) for t in range(1, 1001)]
    assert stored(db_url) == [(n + 1, f"$e{n}") for n in range(1000)]


def test_rows_fed_one_at_a_time_are_committed_as_they_come(db_url) -> None:
    proc = subprocess.Popen(
        [*tickline_command(), "write", "--database", db_url, "--commit-every", "1", "events", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for n in range(3):
            proc.stdin.write(event(n) + b"\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            assert ready, "no token printed for a row written alone"
            assert proc.stdout.readline() == f"{n + 1}\n".encode()
            assert stored(db_url) == [(t + 1, f"$e{t}") for t in range(n + 1)]  # stdin is still open
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_each_transaction_of_a_batch_shares_one_token(db_url) -> None:
    lines = b"".join(event(n) + b"\n" for n in range(5))
    done = run_tickline("write", "--database", db_url, "--batch", "--commit-every", "2", "events", "-", input=lines)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "2", "2", "3"]
    assert [t for t, _ in stored(db_url)] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_n_must_be_a_whole_number_from_one(tmp_path, value) -> None:
    done = run_tickline(
        "write", "--database", f"sqlite:///{tmp_path}/t.db", "--commit-every", value, "events", "-", input=b""
    )
    assert done.returncode == 2
    assert done.stderr.startswith("tickline write: error: argument --commit-every: ")
    assert len(done.stderr.strip().splitlines()) == 1
