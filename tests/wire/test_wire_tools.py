"""``tickline write`` and ``tickline tail`` against a real master."""

from __future__ import annotations

import json
import subprocess
import time

TAIL_TIMEOUT = 20.0


def event(i: int) -> list:
    return [f"$e{i}", "!room", "m.type", None, None]


def test_write_prints_one_token_per_row(master, write) -> None:
    m = master()
    result = write("--database", m.database, "events", json.dumps(event(1)), json.dumps(event(2)))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "1\n2\n"
    # a JSON object by column name works too; missing nullable columns are null
    result = write("--database", m.database, "events", '{"event_id": "$e3", "room_id": "!room", "type": "m.type"}')
    assert result.stdout == "3\n"
    result = write(
        "--database",
        m.database,
        "--batch",
        "--instance",
        "w9",
        "events",
        json.dumps(event(4)),
        json.dumps(event(5)),
        json.dumps(event(6)),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "4\n4\n4\n"
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    assert client.next_command() == "POSITION events master 0 0"
    lines = [client.next_command() for _ in range(6)]
    assert lines == [
        'RDATA events writer 1 ["$e1","!room","m.type",null,null]',
        'RDATA events writer 2 ["$e2","!room","m.type",null,null]',
        'RDATA events writer 3 ["$e3","!room","m.type",null,null]',
        'RDATA events w9 batch ["$e4","!room","m.type",null,null]',
        'RDATA events w9 batch ["$e5","!room","m.type",null,null]',
        'RDATA events w9 4 ["$e6","!room","m.type",null,null]',
    ]


def test_write_errors_are_clear_and_exit_non_zero(write, tmp_path) -> None:
    database = f"sqlite:///{tmp_path / 'w.db'}"
    cases = [
        (("events", "[not json"), ["row 1", "not valid JSON"]),
        (("events", json.dumps(event(1)), "{broken"), ["row 2", "not valid JSON"]),
        (("nosuch", "[1]"), ["unknown stream 'nosuch'", "events"]),
        (("events", '["only", "three", "values"]'), ["events", "expects 5 values"]),
        (("events", '[1, "!room", "m.type", null, null]'), ["event_id", "text"]),
    ]
    for args, words in cases:
        result = write("--database", database, *args)
        assert result.returncode != 0, args
        assert result.stdout == "", args
        assert "Traceback" not in result.stderr
        for word in words:
            assert word in result.stderr, (args, result.stderr)
    result = write("--database", database, "events", "-", input='["a","b","c",null,null]\n\n[oops\n')
    assert result.returncode != 0
    assert "stdin line 3" in result.stderr
    # nothing of a failed command was written
    result = write("--database", database, "events", json.dumps(event(1)))
    assert result.stdout == "1\n"


def test_tail_from_a_token_prints_one_json_object_per_row(master, tickline) -> None:
    m = master()
    m.append("events", [event(1), event(2)])
    m.append("caches", [["cache_a", ["k"], 7]])
    m.append("events", [event(3), event(4)], batch=True)
    m.append("caches", [["cache_b", None, 8]], instance="w2")
    result = tickline(
        "tail", "--master", m.address, "--from", "1", "--count", "4", "events", "caches", timeout=TAIL_TIMEOUT
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    events = [r for r in records if r["stream"] == "events"]
    caches = [r for r in records if r["stream"] == "caches"]
    assert events == [
        {"stream": "events", "instance": "writer", "token": 2, "row": event(2)},
        {"stream": "events", "instance": "writer", "token": 3, "row": event(3)},
        {"stream": "events", "instance": "writer", "token": 3, "row": event(4)},
    ]
    # caches token 1 is not after --from 1; token 2 is
    assert caches == [{"stream": "caches", "instance": "w2", "token": 2, "row": ["cache_b", None, 8]}]
    assert len(records) == 4


def test_tail_with_ts_adds_the_timestamp(master, tickline) -> None:
    m = master()
    m.append("events", [event(1)])
    result = tickline(
        "tail", "--master", m.address, "--from", "0", "--count", "1", "--ts", "events", timeout=TAIL_TIMEOUT
    )
    assert result.returncode == 0, result.stderr
    (record,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert record["row"] == event(1) and record["token"] == 1
    assert isinstance(record["ts"], int) and record["ts"] > 0


def test_tail_follows_live_rows_until_count(master, spawn) -> None:
    m = master()
    tail = spawn("tail", "--master", m.address, "--count", "3", "events")
    written = 0
    deadline = time.monotonic() + TAIL_TIMEOUT
    while tail.poll() is None:  # write until tail has printed its 3 rows and exited
        assert time.monotonic() < deadline, "tail did not exit"
        written += 1
        m.append("events", [event(written)])
        try:
            tail.wait(0.1)
        except subprocess.TimeoutExpired:
            pass
    out, err = tail.communicate(timeout=5)
    assert tail.returncode == 0, err
    records = [json.loads(line) for line in out.decode().splitlines()]
    assert len(records) == 3
    first = records[0]["token"]
    assert [r["token"] for r in records] == [first, first + 1, first + 2]
    assert [r["row"] for r in records] == [event(t) for t in (first, first + 1, first + 2)]


def test_tail_errors_are_clear_and_exit_non_zero(master, tickline, unused_port) -> None:
    m = master()
    m.append("events", [event(1)])
    result = tickline("tail", "--master", m.address, "--from", "0", "nosuch", timeout=TAIL_TIMEOUT)
    assert result.returncode != 0
    assert "unknown stream 'nosuch'" in result.stderr
    result = tickline("tail", "--master", m.address, "--count", "1", "nosuch", timeout=TAIL_TIMEOUT)
    assert result.returncode != 0
    assert "unknown stream 'nosuch'" in result.stderr
    result = tickline("tail", "--master", m.address, "--from", "99", "events", timeout=TAIL_TIMEOUT)
    assert result.returncode != 0
    assert "token 99 is above the head 1" in result.stderr
    result = tickline("tail", "--master", f"127.0.0.1:{unused_port}", "events", timeout=TAIL_TIMEOUT)
    assert result.returncode != 0
    assert "cannot connect to the master" in result.stderr
    result = tickline("tail", "--master", "nonsense", "events", timeout=TAIL_TIMEOUT)
    assert result.returncode != 0
    assert "--master" in result.stderr
    assert "Traceback" not in result.stderr


def test_tail_reports_a_master_that_goes_away(master, spawn) -> None:
    m = master()
    tail = spawn("tail", "--master", m.address, "events")
    m.wait_for_log("tail@")  # it has connected and named itself
    m.stop()
    _, err = tail.communicate(timeout=TAIL_TIMEOUT)
    assert tail.returncode != 0
    assert b"connection to the master closed" in err
