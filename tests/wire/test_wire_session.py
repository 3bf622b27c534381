"""A session with a real ``tickline master`` over TCP: handshake, positions,
keepalive, framing and the command-line options of ``tickline master``."""

from __future__ import annotations

import time

EVENT_ROW = ["$e", "!room", "m.type", None, None]


def test_handshake_is_server_name_then_ping(master) -> None:
    m = master()
    client = m.connect()
    assert client.read_line() == "SERVER tickline"  # the default name
    ping = client.read_line()
    assert ping.startswith("PING ")
    assert abs(int(ping.split()[1]) - time.time() * 1000) < 60_000


def test_server_name_option(master) -> None:
    m = master(server_name="master-a")
    assert m.connect().read_line() == "SERVER master-a"


def test_config_file_gives_name_listen_address_and_database(master, tickline) -> None:
    # no --listen/--database: `tickline master -c FILE` alone
    m = master("server_name: from-config\nlisten: 127.0.0.1:$PORT\ndatabase: $DATABASE\n", options=False)
    m.append("events", [EVENT_ROW])
    client = m.connect()
    assert client.read_line() == "SERVER from-config"
    client.send("REPLICATE events 0")
    assert client.next_command() == "POSITION events master 0 0"
    assert client.next_command().startswith("RDATA events writer 1 ")
    # tail and write find the master and the database through the same file
    assert tickline("write", "-c", str(m.config_path), "events", '["$x","!r","t",null,null]').stdout == "2\n"
    result = tickline("tail", "-c", str(m.config_path), "--from", "1", "--count", "1", "events", timeout=20)
    assert result.returncode == 0, result.stderr
    assert '"token":2' in result.stdout


def test_server_name_option_wins_over_the_config(master) -> None:
    m = master("server_name: from-config\n", server_name="from-cli")
    assert m.connect().read_line() == "SERVER from-cli"


def test_replicate_sends_a_position_for_every_stream(master) -> None:
    m = master()
    m.append("events", [EVENT_ROW] * 3)
    m.append("caches", [["c", None, 1]])
    client = m.connect()
    client.handshake()
    client.send("REPLICATE")
    # POSITION <stream> <instance> <prev> <new> for each stream, at the head the
    # master has followed; rows committed after that follow as RDATA.
    reached = {}
    for _ in range(2):
        _, stream, instance, prev, new = client.next_command().split(" ")
        assert instance == "master" and prev == new
        reached[stream] = int(new)
    assert set(reached) == {"caches", "events"}
    heads = {"caches": 1, "events": 3}
    while reached != heads:
        _, stream, _, token, _ = client.next_command(timeout=2.0).split(" ", 4)
        assert int(token) == reached[stream] + 1
        reached[stream] = int(token)
    assert reached == heads


def test_crlf_and_blank_lines(master) -> None:
    m = master()
    client = m.connect()
    client.handshake()
    client.send_raw(b"\r\n\n   \n\t\r\nNAME crlf-client\r\n  \nREPLICATE caches 0\r\n")
    assert client.next_command() == "POSITION caches master 0 0"
    assert client.try_line(0.3) is None  # the blank lines got no answer


def test_pings_keep_coming_and_silence_times_out_only_after_the_peers_ping(master) -> None:
    m = master("protocol:\n  ping_interval: 0.2\n  ping_timeout: 0.8\n")
    quiet = m.connect()
    quiet.handshake()
    pinged = m.connect()
    pinged.handshake()
    pinged.send("PING 1")
    # The client that pinged and then fell silent is dropped with ERROR.
    started = time.monotonic()
    lines = pinged.wait_closed(timeout=5.0)
    elapsed = time.monotonic() - started
    assert [line for line in lines if not line.startswith("PING ")] == [
        "ERROR ping timeout: nothing received for 0.8 s"
    ]
    assert 0.7 <= elapsed <= 3.0
    assert sum(line.startswith("PING ") for line in lines) >= 2
    # The one that never pinged (a person in netcat) is still connected and
    # still gets a PING at least every ping_interval.
    stamps = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        line = quiet.read_line(1.0)
        assert line.startswith("PING "), line
        stamps.append(time.monotonic())
    assert len(stamps) >= 3
    assert (
        max(b - a for a, b in zip(stamps, stamps[1:], strict=False)) < 0.5
    )  # ping_interval 0.2 s, with slack for load
    quiet.send("REPLICATE caches 0")
    assert quiet.next_command() == "POSITION caches master 0 0"


def test_a_client_that_keeps_sending_is_not_timed_out(master) -> None:
    m = master("protocol:\n  ping_interval: 0.2\n  ping_timeout: 0.6\n")
    client = m.connect()
    client.handshake()
    client.send("PING 1")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        client.send("PING 2")
        line = client.try_line(0.15)
        assert line is None or line.startswith("PING "), line
    client.send("REPLICATE caches 0")
    assert client.next_command() == "POSITION caches master 0 0"


CLIENT_COMMANDS = [
    "USER_SYNC w1 @a:x start 5",
    "USER_SYNC w1 @a:x end 6",
    "CLEAR_USER_SYNC w1",
    "FEDERATION_ACK w1 3",
    "REMOVE_PUSHER m.http k @a:x",
    "NAME w1",
    "PING 123",
    "ERROR my side is sad",
]


def test_client_commands_are_accepted_silently(master) -> None:
    m = master()
    client = m.connect()
    client.handshake()
    for i, command in enumerate(CLIENT_COMMANDS):
        client.send(command, f"BOGUS{i}")  # the sentinel's ERROR must be the next answer
        assert client.next_command() == f"ERROR unknown command 'BOGUS{i}'", command


def test_options_are_answered_with_what_was_accepted(master) -> None:
    m = master()
    client = m.connect()
    client.handshake()
    client.send("OPTIONS ts gzip live", "OPTIONS zstd", "REPLICATE caches 0")
    assert client.next_command() == "OPTIONS live ts"  # gzip is unknown: not acknowledged
    assert client.next_command() == "OPTIONS"  # nothing accepted
    assert client.next_command() == "POSITION caches master 0 0"


def test_remote_server_up_is_relayed_to_the_other_connections(master) -> None:
    m = master()
    sender, other1, other2 = m.connect(), m.connect(), m.connect()
    for client in (sender, other1, other2):
        client.handshake()
    sender.send("REMOTE_SERVER_UP example.org")
    assert other1.next_command() == "REMOTE_SERVER_UP example.org"
    assert other2.next_command() == "REMOTE_SERVER_UP example.org"
    sender.send("BOGUS")
    assert sender.next_command() == "ERROR unknown command 'BOGUS'"  # not echoed to the sender


def test_auth_secret(master) -> None:
    m = master("secret: s3cret\n")
    anonymous = m.connect()
    anonymous.handshake()
    anonymous.send("PING 1", "REPLICATE")
    lines = anonymous.wait_closed()
    assert [line for line in lines if not line.startswith("PING")] == [
        "ERROR authentication required: send AUTH <secret> before REPLICATE"
    ]
    wrong = m.connect()
    wrong.handshake()
    wrong.send("AUTH nope")
    assert [line for line in wrong.wait_closed() if not line.startswith("PING")] == [
        "ERROR authentication failed: wrong secret"
    ]
    right = m.connect()
    right.handshake()
    right.send("AUTH s3cret", "REPLICATE caches 0")
    assert right.next_command() == "POSITION caches master 0 0"


def test_master_reports_bad_database_url_and_exits(tickline, tmp_path) -> None:
    result = tickline("master", "--listen", "127.0.0.1:0", "--database", "mysql://nope", timeout=20)
    assert result.returncode != 0
    assert "mysql://nope" in result.stderr


def test_master_reports_a_busy_port_and_exits(master, tickline, tmp_path) -> None:
    m = master()
    result = tickline("master", "--listen", m.address, "--database", f"sqlite:///{tmp_path / 'other.db'}", timeout=20)
    assert result.returncode != 0
    assert "error" in result.stderr.lower()
