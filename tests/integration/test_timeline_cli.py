"""``tickline timeline``: schedule, move, cancel, list, stats and consume against a real master."""

from __future__ import annotations

import json
import time

import pytest

from scripts.cli import UsageError
from scripts.timeline_cli import parse_time


def test_times() -> None:
    assert parse_time("+30s") == (30_000, True)
    assert parse_time("+5m") == (300_000, True)
    assert parse_time("+250ms") == (250, True)
    assert parse_time("+2h") == (7_200_000, True)
    assert parse_time("+1d") == (86_400_000, True)
    assert parse_time("+15") == (15, True)
    assert parse_time("now") == (0, True)
    assert parse_time("1700000000000") == (1_700_000_000_000, False)
    assert parse_time("2030-01-02T03:04:05Z") == (1_893_553_445_000, False)
    assert parse_time("2030-01-02T04:04:05+01:00") == (1_893_553_445_000, False)
    assert parse_time("2030-01-02T03:04:05") == (1_893_553_445_000, False)  # no zone: UTC
    with pytest.raises(UsageError, match="bad time 'soon'"):
        parse_time("soon")
    with pytest.raises(UsageError):
        parse_time("+5y")


def test_schedule_list_stats_move_cancel_consume(master, tickline) -> None:
    m = master()
    wire = ["--master", m.address]
    db = ["--database", m.database]
    out = tickline("timeline", "schedule", *wire, "jobs", "--id", "r1", "--at", "+1h", '{"to": "a"}')
    assert out.returncode == 0, out.stderr
    ack = json.loads(out.stdout)
    assert ack["id"] == "r1" and ack["version"] == 1 and ack["timestamp"] > time.time() * 1000 + 3_500_000
    out = tickline("timeline", "schedule", *wire, "jobs", "--at", "2030-01-02T03:04:05Z", "[1]")
    generated = json.loads(out.stdout)
    assert generated["timestamp"] == 1_893_553_445_000 and len(generated["id"]) == 26
    stats = json.loads(tickline("timeline", "stats", *db, "jobs").stdout)
    assert (stats["waiting"], stats["available"], stats["processing"]) == (2, 0, 0)
    stats = json.loads(tickline("timeline", "stats", *db, "jobs", "--from", "+2h").stdout)
    assert stats["total"] == 1
    listed = [
        json.loads(line)
        for line in tickline("timeline", "list", *db, "jobs", "--status", "waiting").stdout.split("\n")
        if line
    ]
    assert [x["id"] for x in listed] == ["r1", generated["id"]]
    assert listed[0]["body"] == {"to": "a"}
    refused = tickline("timeline", "move", *wire, "--group", "other", "jobs", "r1", "--at", "now")
    assert refused.returncode == 1 and "refused: not the owner" in refused.stderr
    moved = tickline("timeline", "move", *wire, "jobs", "r1", "--at", "now")
    assert moved.returncode == 0 and json.loads(moved.stdout)["version"] == 2
    assert tickline("timeline", "cancel", *wire, "jobs", generated["id"]).returncode == 0
    consumed = tickline("timeline", "consume", *wire, "jobs", "--count", "1", "--lease", "10s")
    assert consumed.returncode == 0, consumed.stderr
    leased = json.loads(consumed.stdout)
    assert leased["id"] == "r1" and leased["body"] == {"to": "a"} and leased["version"] == 3
    stats = json.loads(tickline("timeline", "stats", *db, "jobs").stdout)
    assert stats["total"] == 0  # consumed messages are deleted


@pytest.mark.parametrize(
    "args, message",
    [
        (["schedule", "jobs", "--at", "soon", "{}"], "bad --at 'soon'"),
        (["schedule", "jobs", "{bad"], "BODY_JSON is not valid JSON"),
        (["schedule", "nope", "1"], "unknown topic 'nope'"),
        (["consume", "jobs", "--credit", "0"], "--credit must be at least 1"),
        (["consume", "jobs", "--lease", "forever"], "bad --lease"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(master, tickline, args: list[str], message: str) -> None:
    m = master()
    out = tickline("timeline", args[0], "--master", m.address, *args[1:])
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_unreachable_master_and_unknown_topic_on_read(tickline, unused_port: int, tmp_path) -> None:
    out = tickline("timeline", "schedule", "--master", f"127.0.0.1:{unused_port}", "jobs", "{}")
    assert out.returncode == 2 and "cannot connect to the master" in out.stderr
    out = tickline("timeline", "stats", "--database", f"sqlite:///{tmp_path}/x.db", "nope")
    assert out.returncode == 2 and "unknown topic 'nope'" in out.stderr
