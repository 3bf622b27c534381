"""The timeline's command classes: round trips, limits, malformed arguments."""

from __future__ import annotations

import pytest

from replication.commands import (
    Command,
    MalformedCommand,
    parse_line,
)
from replication.timeline_commands import (
    AckCommand,
    CancelCommand,
    DeleteCommand,
    ExtendCommand,
    LeaseCommand,
    MoveCommand,
    NackCommand,
    ReleaseCommand,
    ScheduleCommand,
    TimelineCommand,
)

ROUND_TRIPS = [
    ("TIMELINE jobs worker-1 10 30000", TimelineCommand("jobs", "worker-1", 10, 30000)),
    ("EXTEND jobs 01HX 3 5000", ExtendCommand("jobs", "01HX", 3, 5000)),
    ("RELEASE jobs a 3 0", ReleaseCommand("jobs", "a", 3, 0)),
    ("DELETE jobs a 3", DeleteCommand("jobs", "a", 3)),
    (
        'SCHEDULE jobs g a 1700000000000 {"to":"a b"}',
        ScheduleCommand("jobs", "g", "a", 1700000000000, False, '{"to":"a b"}'),
    ),
    ("SCHEDULE jobs g - +500 [1,2]", ScheduleCommand("jobs", "g", None, 500, True, "[1,2]")),
    ("MOVE jobs g a +60000", MoveCommand("jobs", "g", "a", 60000, True)),
    ("MOVE jobs g a 1700000000000", MoveCommand("jobs", "g", "a", 1700000000000, False)),
    ("CANCEL jobs g a", CancelCommand("jobs", "g", "a")),
    ('LEASE jobs a 2 1700000030000 {"x":1}', LeaseCommand("jobs", "a", 2, 1700000030000, '{"x":1}')),
    ("ACK DELETE jobs a 4 1700000000001", AckCommand("DELETE", "jobs", "a", 4, 1700000000001)),
    ("NACK DELETE jobs a not the holder", NackCommand("DELETE", "jobs", "a", "not the holder")),
]


@pytest.mark.parametrize("line, command", ROUND_TRIPS, ids=[line[:40] for line, _ in ROUND_TRIPS])
def test_round_trip(line: str, command: Command) -> None:
    parsed = parse_line(line)
    assert parsed == command
    assert parsed.to_line() == line


def test_body_is_normalized_to_compact_json() -> None:
    parsed = parse_line('SCHEDULE jobs g a +0 { "x" : [ 1, 2 ] }')
    assert isinstance(parsed, ScheduleCommand) and parsed.body == '{"x":[1,2]}'


@pytest.mark.parametrize(
    "line, message",
    [
        ("TIMELINE jobs c 0 1000", "credit must be between 1 and"),
        ("TIMELINE jobs c 10001 1000", "credit must be between"),
        ("TIMELINE jobs c 1 0", "lease_ms must be between"),
        ("TIMELINE jobs c 1", "expected TIMELINE <topic> <consumer_id> <credit> <lease_ms>"),
        ("TIMELINE jobs c x 1000", "credit must be a non-negative integer"),
        ("EXTEND jobs a -1 100", "version must be a non-negative integer"),
        ("RELEASE jobs a 1", "expected RELEASE"),
        ("DELETE jobs a", "expected DELETE <topic> <id> <version>"),
        ("DELETE jobs a 1 extra", "expected DELETE"),
        ("SCHEDULE jobs g a 100 {bad", "bad body JSON"),
        ("SCHEDULE jobs g a soon {}", "at (Unix ms or +ms)"),
        ("SCHEDULE jobs g a +x {}", "at (+ms)"),
        ("SCHEDULE jobs g " + "x" * 201 + " 1 {}", "id is longer than 200"),
        ("MOVE jobs g a", "expected MOVE"),
        ("CANCEL jobs g", "expected CANCEL"),
        ("ACK TIMELINE jobs a 1 1", "command must be one of"),
    ],
)
def test_malformed(line: str, message: str) -> None:
    with pytest.raises(MalformedCommand, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        parse_line(line)


# A process that has not imported replication.timeline_commands (a worker: see
# tests/unit/test_worker_start_imports.py) parses the timeline's lines all the same.
_FRESH = """
import sys
from replication.commands import TIMELINE_COMMAND_NAMES, parse_line

assert "replication.timeline_commands" not in sys.modules
command = parse_line(sys.argv[1])
from replication.timeline_commands import LeaseCommand

assert type(command) is LeaseCommand, command
print(command.to_line())
"""


def test_a_timeline_line_is_parsed_where_its_module_was_not_imported() -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    line = 'LEASE jobs m1 1 1700000000000 {"a":1}'
    out = subprocess.run([sys.executable, "-c", _FRESH, line], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == parse_line(line).to_line()
