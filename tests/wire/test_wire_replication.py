"""Rows through a real master: live RDATA, batches, replay with ``REPLICATE
<stream> <token>``, large replays, config-declared streams."""

from __future__ import annotations

import json
import threading
import time

import orjson

EVENT_ROW = ["$e", "!room", "m.type", None, None]


def event(i: int) -> list:
    return [f"$e{i}", "!room", "m.type", None, None]


def parse_rdata(line: str) -> tuple[str, str, str, list]:
    name, stream, instance, token, row = line.split(" ", 4)
    assert name == "RDATA", line
    return stream, instance, token, orjson.loads(row)


def live_client(m):
    """A client after plain REPLICATE, with the positions it was given."""
    client = m.connect()
    client.handshake()
    client.send("REPLICATE")
    positions: dict[str, int] = {}
    while len(positions) < 2:
        _, stream, _, _, new = client.next_command().split(" ")
        positions[stream] = int(new)
    return client, positions


def test_new_rows_go_out_as_rdata_within_100_ms_of_commit(master) -> None:
    m = master()
    client, _positions = live_client(m)
    latencies = []
    for i in range(1, 11):
        (token,) = m.append("events", [event(i)])
        committed = time.monotonic()
        line = client.next_command(timeout=2.0)
        latencies.append(time.monotonic() - committed)
        assert line == f'RDATA events writer {token} ["$e{i}","!room","m.type",null,null]'
    latencies.sort()
    # every row well within the bound; allow one outlier on a loaded machine
    assert latencies[-2] < 0.100, latencies
    assert latencies[-1] < 0.300, latencies


def test_rows_written_by_tickline_write_reach_live_clients(master) -> None:
    m = master()
    clients = [live_client(m)[0] for _ in range(3)]
    tokens = m.write("events", json.dumps(event(1)), json.dumps(event(2)), instance="writer-b")
    assert tokens == [1, 2]
    (_cache_token,) = m.write("caches", '["room_cache", ["!room"], 12345]')
    for client in clients:
        got = sorted(client.next_command(timeout=2.0) for _ in range(3))
        assert got == [
            'RDATA caches writer 1 ["room_cache",["!room"],12345]',
            'RDATA events writer-b 1 ["$e1","!room","m.type",null,null]',
            'RDATA events writer-b 2 ["$e2","!room","m.type",null,null]',
        ]


def test_a_batch_goes_out_as_batch_lines_then_the_real_token(master) -> None:
    m = master()
    client, _ = live_client(m)
    m.append("events", [event(0)])
    rows = [json.dumps(event(i)) for i in range(1, 5)]
    (token, *rest) = m.write("events", *rows, batch=True)
    assert rest == [token] * 3  # `tickline write --batch` prints the shared token per row
    lines = [client.next_command(timeout=2.0) for _ in range(5)]
    assert lines[0].startswith("RDATA events writer 1 ")
    assert [parse_rdata(line)[2] for line in lines[1:]] == ["batch", "batch", "batch", str(token)]
    assert [parse_rdata(line)[3] for line in lines[1:]] == [event(i) for i in range(1, 5)]
    assert token == 2


def test_replicate_from_a_token_replays_in_order_then_continues_live(master) -> None:
    m = master()
    m.append("events", [event(i) for i in range(1, 11)])
    m.append("caches", [["c", None, 1]])
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 4")
    assert client.next_command() == "POSITION events master 4 4"
    replayed = [parse_rdata(client.next_command()) for _ in range(6)]
    assert [(s, t, row) for s, _, t, row in replayed] == [("events", str(i), event(i)) for i in range(5, 11)]
    m.append("events", [event(11)])
    m.append("caches", [["c", None, 2]])  # not asked for on this connection
    assert client.next_command(timeout=2.0) == 'RDATA events writer 11 ["$e11","!room","m.type",null,null]'
    assert client.try_line(0.3) is None, "no rows of streams not replicated"


def test_replicate_at_the_head_is_live_at_once(master) -> None:
    m = master()
    m.append("events", [event(1), event(2)])
    client = m.connect()
    client.handshake()
    # at once after the commit: the master may not have followed it yet, but
    # a committed token is never "above the head"
    client.send("REPLICATE events 2")
    assert client.next_command() == "POSITION events master 2 2"
    m.append("events", [event(3)])
    assert client.next_command(timeout=2.0).startswith("RDATA events writer 3 ")


def test_large_replay_from_stdin_rows_then_live(master, write) -> None:
    m = master()
    count = 50_000
    stdin = "".join(json.dumps(event(i)) + "\n" for i in range(1, count + 1))
    result = write("--database", m.database, "events", "-", input=stdin)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(t) for t in range(1, count + 1)]
    client = m.connect(timeout=20.0)
    client.handshake()
    client.send("REPLICATE events 0")
    assert client.next_command() == "POSITION events master 0 0"
    expected = 1
    deadline = time.monotonic() + 30
    while expected <= count:
        assert time.monotonic() < deadline
        line = client.read_line()
        if line.startswith("PING "):
            continue
        assert line.startswith(f"RDATA events writer {expected} "), line
        assert line.endswith(f'["$e{expected}","!room","m.type",null,null]'), line
        expected += 1
    m.append("events", [event(count + 1)])
    assert client.next_command(timeout=2.0).startswith(f"RDATA events writer {count + 1} ")


def test_replay_during_concurrent_writes_has_no_gap_and_no_duplicate(master) -> None:
    """The hand-over from replay to live while rows keep arriving."""
    m = master("protocol:\n  catchup_rows: 50\n")
    m.append("events", [event(i) for i in range(1, 2001)])
    total = 3000
    errors = []

    def writer() -> None:
        try:
            from storage.store import open_store

            store = open_store(m.database)
            for i in range(2001, total + 1, 10):
                store.append("events", [event(j) for j in range(i, i + 10)], "w2")
            store.close()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=writer)
    client = m.connect()
    client.handshake()
    client.send("REPLICATE events 0")
    thread.start()
    assert client.next_command() == "POSITION events master 0 0"
    seen: list[int] = []
    try:
        while len(seen) < total:
            _, _, token, row = parse_rdata(client.next_command(timeout=5.0))
            seen.append(int(token))
            assert row == event(int(token))
    finally:
        thread.join(10)
    assert not errors
    assert seen == list(range(1, total + 1))


def test_options_ts_adds_the_timestamp_on_the_wire(master) -> None:
    m = master()
    m.append("events", [event(1)])
    client = m.connect()
    client.handshake()
    client.send("OPTIONS ts", "REPLICATE events 0")
    assert client.next_command() == "OPTIONS ts"
    assert client.next_command() == "POSITION events master 0 0"
    _, _, _, row = parse_rdata(client.next_command())
    assert row[:-1] == event(1)
    assert isinstance(row[-1], int)
    assert abs((row[-1] >> 18) - time.time() * 1000) < 60_000  # 46 bits of Unix ms


DECLARED = """
streams:
  measurements:
    columns:
      - {name: sensor, type: text}
      - {name: reading, type: bigint}
      - {name: value, type: double}
      - {name: ok, type: boolean}
      - {name: extra, type: json, nullable: true}
      - {name: note, type: text, nullable: true}
"""


def test_config_declared_stream_behaves_like_a_built_in(master, tickline) -> None:
    m = master(DECLARED)
    # positions: the declared stream is announced like the built-ins
    observer = m.connect()
    observer.handshake()
    observer.send("REPLICATE")
    positions = sorted(observer.next_command() for _ in range(3))
    assert positions == [
        "POSITION caches master 0 0",
        "POSITION events master 0 0",
        "POSITION measurements master 0 0",
    ]
    # write (through the CLI, with the same config)
    result = tickline(
        "write",
        "-c",
        str(m.config_path),
        "--database",
        m.database,
        "--instance",
        "probe",
        "measurements",
        '["t1", 9007199254740993, 21.5, true, {"unit": "C", "tags": [1, 2]}, null]',
        '{"sensor": "t2", "reading": -1, "value": 3, "ok": false}',
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "2"]
    expected = [
        ["t1", 9007199254740993, 21.5, True, {"unit": "C", "tags": [1, 2]}, None],
        ["t2", -1, 3.0, False, None, None],
    ]
    # live
    live = [parse_rdata(observer.next_command(timeout=2.0)) for _ in range(2)]
    assert [(s, i, t, row) for s, i, t, row in live] == [
        ("measurements", "probe", "1", expected[0]),
        ("measurements", "probe", "2", expected[1]),
    ]
    # replay
    replayer = m.connect()
    replayer.handshake()
    replayer.send("REPLICATE measurements 0")
    assert replayer.next_command() == "POSITION measurements master 0 0"
    assert [parse_rdata(replayer.next_command())[3] for _ in range(2)] == expected
    # tail
    result = tickline(
        "tail",
        "-c",
        str(m.config_path),
        "--master",
        m.address,
        "--from",
        "0",
        "--count",
        "2",
        "measurements",
        timeout=20,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert records == [
        {"stream": "measurements", "instance": "probe", "token": 1, "row": expected[0]},
        {"stream": "measurements", "instance": "probe", "token": 2, "row": expected[1]},
    ]
    # bad rows for the declared types are refused with a clear message
    result = tickline(
        "write",
        "-c",
        str(m.config_path),
        "--database",
        m.database,
        "measurements",
        '["t3", "not a number", 1.0, true, null, null]',
    )
    assert result.returncode != 0
    assert "reading" in result.stderr and "bigint" in result.stderr


def test_rows_of_a_stream_declared_after_the_master_started(master, tickline, tmp_path) -> None:
    m = master()
    config = tmp_path / "later.yaml"
    config.write_text("streams:\n  late:\n    columns:\n      - {name: body, type: text}\n")
    result = tickline("write", "-c", str(config), "--database", m.database, "late", '["hello"]')
    assert result.returncode == 0, result.stderr
    client = m.connect()
    client.handshake()
    client.send("REPLICATE late 0")  # the master learns the stream from the store
    assert client.next_command() == "POSITION late master 0 0"
    assert client.next_command() == 'RDATA late writer 1 ["hello"]'


def test_sqlite_commits_of_other_processes_are_seen_by_the_change_check(master) -> None:
    """With full passes rare (poll_interval, tick_interval 30 s), PRAGMA data_version finds commits at once."""
    m = master("master:\n  poll_interval: 30\n  tick_interval: 30\n  change_check_interval: 0.005\n")
    client, _positions = live_client(m)
    latencies = []
    for i in range(1, 6):
        (token,) = m.write("events", json.dumps(event(i)))  # another process
        committed = time.monotonic()
        line = client.next_command(timeout=5.0)
        latencies.append(time.monotonic() - committed)
        assert line == f'RDATA events writer {token} ["$e{i}","!room","m.type",null,null]'
    # Far below the 30 s of the full passes (the write's own process exit is in it too).
    assert sorted(latencies)[-2] < 1.0, latencies
