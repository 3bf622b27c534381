"""``tickline write`` commits all of its rows or none, on both backends, as a real process.

10,000 good lines and then a bad one: nothing committed, the error names the
line (and the column, or the stream's column whose type is wrong); after the
line is fixed the same input commits exactly once. Tokens are printed only
after the commit. A storage failure in the middle (a file-size limit standing
in for a full disk) is one line, exit code 2, nothing committed.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import orjson
import pytest

from storage.bulk import TokenRuns
from storage.store import open_store
from tests.conftest import ROOT, _env, run_tickline, tickline_command

GOOD = 10_000


def event(n: int) -> bytes:
    return orjson.dumps([f"$e{n}", "!room", "m.room.message", None, None])


def stdin_with(bad: bytes, good: int = GOOD) -> bytes:
    return b"\n".join([event(n) for n in range(good)] + [bad]) + b"\n"


def head(url: str) -> int:
    store = open_store(url)
    try:
        return store.heads().get("events", 0)
    finally:
        store.close()


def count_rows(url: str) -> int:
    store = open_store(url)
    try:
        return len(store.read_rows("events", 0, 10**9, 10**9))
    finally:
        store.close()


@pytest.mark.parametrize(
    "bad, message",
    [
        (b'["$x", "!r", "t", null', f"stdin line {GOOD + 1} is not valid JSON at column 23"),
        (b'["$x", "!r", 7, null, null]', f"stdin line {GOOD + 1}: stream 'events': column 'type' expects text"),
        (b'["$x", "!r"]', f"stdin line {GOOD + 1}: stream 'events' expects 5 values"),
        (b'["$x", "\xff", "t", null, null]', f"stdin line {GOOD + 1} is not valid UTF-8 at byte 9"),
        (b"[" * 5000 + b"]" * 5000, f"stdin line {GOOD + 1} is not valid JSON"),  # deeper than any parser goes
        (orjson.dumps(["$x" * 40000, "!r", "t", None, None]), f"stdin line {GOOD + 1}: stream 'events': the row's"),
    ],
)
def test_a_bad_line_after_10000_good_ones_commits_nothing_and_is_named(db_url, bad, message) -> None:
    result = run_tickline("write", "--database", db_url, "events", "-", input=stdin_with(bad))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # no token printed: nothing committed
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert count_rows(db_url) == 0

    fixed = run_tickline("write", "--database", db_url, "events", "-", input=stdin_with(event(GOOD)))
    assert fixed.returncode == 0, fixed.stderr
    tokens = [int(t) for t in fixed.stdout.split()]
    # SQLite starts at 1; a PostgreSQL sequence does not give back what a rolled-back write took.
    assert tokens == list(range(tokens[0], tokens[0] + GOOD + 1))
    assert count_rows(db_url) == GOOD + 1


def test_batch_from_stdin_is_one_token_across_chunks(db_url) -> None:
    result = run_tickline("write", "--database", db_url, "--batch", "events", "-", input=stdin_with(event(-1), 4500))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"] * 4501
    assert head(db_url) == 1 and count_rows(db_url) == 4501


def test_arguments_and_stdin_together_are_one_write(db_url) -> None:
    first = event(1).decode()
    result = run_tickline("write", "--database", db_url, "events", first, "-", '["$z"]', input=stdin_with(event(2), 3))
    assert result.returncode == 2 and "row 3: stream 'events' expects 5 values" in result.stderr
    assert count_rows(db_url) == 0


def test_a_full_disk_mid_write_is_one_line_and_commits_nothing(tmp_path) -> None:
    """RLIMIT_FSIZE makes the database's writes fail part-way, as a full disk does."""
    url = f"sqlite:///{tmp_path}/t.db"
    assert run_tickline("write", "--database", url, "events", event(0).decode()).returncode == 0
    size = sum(os.path.getsize(tmp_path / name) for name in os.listdir(tmp_path))

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 200_000, size + 200_000))

    big = b"\n".join(orjson.dumps([f"$e{n}" + "x" * 500, "!r", "t", None, None]) for n in range(20_000))
    proc = subprocess.run(
        [*tickline_command(), "write", "--database", url, "events", "-"],
        input=big,
        capture_output=True,
        timeout=120,
        cwd=ROOT,
        env=_env(),
        preexec_fn=limit_file_size,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert proc.stdout == b""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "nothing was committed" in err or "nothing was written" in err
    assert count_rows(url) == 1


def test_token_runs_are_compact_and_in_order() -> None:
    runs = TokenRuns()
    runs.add(range(1, 100_001))
    runs.add([100_001] * 5)
    runs.add([200_000, 200_001, 300_000])
    assert runs.runs == 4 and len(runs) == 100_008
    tokens = list(runs)
    assert tokens[:2] == [1, 2] and tokens[99_999:100_006] == [100_000] + [100_001] * 5 + [200_000]
    assert tokens[-2:] == [200_001, 300_000]


def test_a_large_input_streams_in_bounded_memory(tmp_path) -> None:
    """200,000 lines (about 50 MB): held at once they would take several hundred MB."""
    source = tmp_path / "rows.txt"
    with open(source, "wb") as f:
        for n in range(200_000):
            f.write(orjson.dumps([f"$e{n}" + "x" * 200, "!room", "m.room.message", None, None]) + b"\n")
    url = f"sqlite:///{tmp_path}/t.db"
    # A wrapper process, so that the peak resident set measured is the writer's alone.
    measure = (
        "import resource, subprocess, sys\n"
        "with open(sys.argv[1], 'rb') as f:\n"
        "    code = subprocess.run(sys.argv[2:], stdin=f, stdout=subprocess.DEVNULL).returncode\n"
        "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", measure, str(source), *tickline_command(), "write", "--database", url, "events", "-"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=_env(),
    )
    code, peak_kb = map(int, out.stdout.split())
    assert code == 0, out.stderr
    assert count_rows(url) == 200_000
    assert peak_kb < 80_000, f"peak RSS {peak_kb} kB"  # about 25 MB; holding every row took 210 MB


def test_a_storage_error_mid_write_on_postgresql_commits_nothing(pg_url) -> None:
    """A trigger that fails on the 7,000th row stands in for PostgreSQL running out of disk."""
    import psycopg2

    assert run_tickline("write", "--database", pg_url, "events", event(0).decode()).returncode == 0
    conn = psycopg2.connect(pg_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "CREATE FUNCTION fail_at_7000() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.event_id = '$e7000' THEN RAISE EXCEPTION 'could not extend file: No space left on device' "
            "USING HINT = 'Check free disk space.'; END IF; RETURN NEW; END $$"
        )
        cur.execute(
            "CREATE TRIGGER disk_full BEFORE INSERT ON stream_events FOR EACH ROW EXECUTE FUNCTION fail_at_7000()"
        )
    conn.close()
    result = run_tickline("write", "--database", pg_url, "events", "-", input=stdin_with(event(10_001)))
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "nothing was committed" in line and "No space left on device" in line and "Traceback" not in line
    assert count_rows(pg_url) == 1


def test_tokens_into_a_reader_that_goes_away(tmp_path) -> None:
    """``tickline write ... | head -1``: the rows are committed, no traceback, exit 0."""
    url = f"sqlite:///{tmp_path}/t.db"
    proc = subprocess.Popen(
        [*tickline_command(), "write", "--database", url, "events", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(stdin_with(event(-1), 50_000))
    proc.stdin.close()
    assert proc.stdout.readline() == b"1\n"
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""
    assert count_rows(url) == 50_001
