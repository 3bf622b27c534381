"""A person with netcat: ``nc -q1`` half-closes after its input, and the master
still answers what it owes before closing."""

from __future__ import annotations

import subprocess


def nc(nc_path: str, m, text: str, timeout: float = 15.0) -> list[str]:
    result = subprocess.run(
        [nc_path, "-q1", m.host, str(m.port)], input=text.encode(), capture_output=True, timeout=timeout
    )
    return result.stdout.decode("utf-8").splitlines()


def test_nc_replicate_prints_handshake_and_positions(master, nc_path) -> None:
    m = master(server_name="nc-master")
    observer = m.connect()
    observer.handshake()
    observer.send("REPLICATE events 0")
    assert observer.next_command() == "POSITION events master 0 0"
    m.append("events", [["$e1", "!r", "t", None, None]] * 4)
    for _ in range(4):  # the master has followed the rows once the observer has them
        assert observer.next_command().startswith("RDATA events writer ")
    lines = nc(nc_path, m, "REPLICATE\n")
    assert lines[0] == "SERVER nc-master"
    assert lines[1].startswith("PING ")
    positions = sorted(line for line in lines[2:] if not line.startswith("PING "))
    assert positions == ["POSITION caches master 0 0", "POSITION events master 4 4"]


def test_nc_replicate_right_after_a_commit_prints_the_new_rows_too(master, nc_path) -> None:
    m = master()
    m.append("events", [["$e1", "!r", "t", None, None]])
    lines = [line for line in nc(nc_path, m, "REPLICATE\n") if not line.startswith("PING ")]
    # Either the master had followed the commit (POSITION at 1) or it sends the
    # row live after POSITION 0 before closing: the row is never missing.
    assert lines[0] == "SERVER tickline"
    assert "POSITION caches master 0 0" in lines
    assert lines[1:] in (
        ["POSITION caches master 0 0", "POSITION events master 1 1"],
        [
            "POSITION caches master 0 0",
            "POSITION events master 0 0",
            'RDATA events writer 1 ["$e1","!r","t",null,null]',
        ],
    )


def test_nc_replicate_from_a_token_prints_the_replayed_rows(master, nc_path) -> None:
    m = master()
    m.append("events", [[f"$e{i}", "!r", "t", None, None] for i in range(1, 4)])
    m.append("events", [["$b1", "!r", "t", None, None], ["$b2", "!r", "t", "k", None]], batch=True)
    lines = nc(nc_path, m, "REPLICATE events 0\n")
    assert lines[0] == "SERVER tickline"
    assert [line for line in lines[1:] if not line.startswith("PING ")] == [
        "POSITION events master 0 0",
        'RDATA events writer 1 ["$e1","!r","t",null,null]',
        'RDATA events writer 2 ["$e2","!r","t",null,null]',
        'RDATA events writer 3 ["$e3","!r","t",null,null]',
        'RDATA events writer batch ["$b1","!r","t",null,null]',
        'RDATA events writer 4 ["$b2","!r","t","k",null]',
    ]


def test_nc_session_with_mistakes_and_no_final_newline(master, nc_path) -> None:
    m = master()
    lines = nc(nc_path, m, "hello\r\n\nNAME person\nREPLICATE caches 0")  # last line without \n
    assert [line for line in lines if not line.startswith("PING ")] == [
        "SERVER tickline",
        "ERROR unknown command 'hello'",
        "POSITION caches master 0 0",
    ]
