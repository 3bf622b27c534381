"""``tickline write``: tokens printed, batches, rows from stdin, and each bad input."""

from __future__ import annotations

import io

import pytest

from scripts.cli import main
from storage.store import TOKEN, open_store

EVENT = '["$e", "!r", "m.room.message", null, null]'


@pytest.fixture
def db(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/t.db"


def write(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["write", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_prints_one_token_per_row(db, capsys) -> None:
    assert write(capsys, "--database", db, "events", EVENT, EVENT) == (0, "1\n2\n", "")
    assert write(capsys, "--database", db, "--batch", "events", EVENT, EVENT, EVENT) == (0, "3\n3\n3\n", "")


def test_rows_from_stdin(db, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{EVENT}\n\n{EVENT}\n"))
    assert write(capsys, "--database", db, "events", "-") == (0, "1\n2\n", "")


def test_instance_is_recorded(db, capsys) -> None:
    write(capsys, "--database", db, "--instance", "w7", "events", EVENT)
    (row,) = open_store(db).read_rows("events", 0, 10, 10)
    assert row[2] == "w7" and row[TOKEN] == 1


def test_config_declared_stream(db, capsys, tmp_path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        f"database: {db}\nstreams:\n  metrics:\n    columns:\n      - {{name: host, type: text}}\n"
        "      - {name: value, type: double}\n"
    )
    assert write(capsys, "-c", str(config), "metrics", '["h1", 0.5]') == (0, "1\n", "")
    # Another writer without the config finds the stream in the database's catalog.
    assert write(capsys, "--database", db, "metrics", '{"host": "h2", "value": 2}') == (0, "2\n", "")


@pytest.mark.parametrize(
    "args, message",
    [
        (["events", "[not json"], "row 1 is not valid JSON"),
        (["events", EVENT, '["$e", "!r"]'], "expects 5 values"),
        (["nosuch", EVENT], "unknown stream 'nosuch'"),
        (["events", '["$e", "!r", 5, null, null]'], "'type' expects text"),
        (["--instance", "two words", "events", EVENT], "bad instance name"),
    ],
)
def test_bad_input_is_refused_and_writes_nothing(db, capsys, args, message) -> None:
    code, out, err = write(capsys, "--database", db, *args)
    assert code == 2 and out == ""
    assert message in err
    assert open_store(db).heads().get("events", 0) == 0


def test_bad_database_urls(tmp_path, capsys) -> None:
    code, _, err = write(capsys, "--database", "mysql://x/y", "events", EVENT)
    assert code == 2 and "unsupported database URL" in err
    code, _, err = write(capsys, "--database", f"sqlite:///{tmp_path}/nodir/t.db", "events", EVENT)
    assert code == 2 and "does not exist" in err


def test_instance_names_must_be_printable_ascii_as_the_wire_needs(db, capsys) -> None:
    code, _out, err = write(capsys, "--database", db, "--instance", "wr\u00efter", "events", EVENT)
    assert code == 2 and "bad instance name" in err and "printable ASCII" in err


def test_empty_stdin_is_a_clear_error(db, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, _out, err = write(capsys, "--database", db, "--batch", "events", "-")
    assert code == 2 and "no rows to write" in err


def test_objects_from_stdin_store_the_same_values_as_arrays_on_both_backends(db_url, capsys, monkeypatch) -> None:
    """Objects take the writers' fast path (values in column order); missing nullable columns are null."""
    lines = [
        '{"event_id": "$a", "room_id": "!r", "type": "m.room.message"}',
        '{"type": "m.room.member", "room_id": "!r", "event_id": "$b", "state_key": "@u"}\r',
        "   ",
        '["$c", "!r", "m.room.message", null, "$a"]',
    ]
    monkeypatch.setattr("sys.stdin", io.BytesIO(("\n".join(lines) + "\n").encode()))
    assert write(capsys, "--database", db_url, "events", "-") == (0, "1\n2\n3\n", "")
    rows = open_store(db_url).read_rows("events", 0, 10, 10)
    assert [row[-5:] for row in rows] == [
        ("$a", "!r", "m.room.message", None, None),
        ("$b", "!r", "m.room.member", "@u", None),
        ("$c", "!r", "m.room.message", None, "$a"),
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        (
            '{"event_id": "$a", "room_id": "!r", "type": "m", "colour": "red"}',
            "stdin line 2: stream 'events' has no column 'colour'",
        ),
        ('{"event_id": "$a", "type": "m"}', "stdin line 2: stream 'events': column 'room_id' may not be null"),
        ('{"event_id": "$a", "room_id": 7, "type": "m"}', "'room_id' expects text"),
        ('{"event_id": "$a", "room_id": "!r", "type": "m"', "stdin line 2 is not valid JSON"),
    ],
)
def test_bad_objects_from_stdin_are_named_and_nothing_is_written(db_url, capsys, monkeypatch, line, message) -> None:
    good = '{"event_id": "$z", "room_id": "!r", "type": "m.room.message"}'
    monkeypatch.setattr("sys.stdin", io.BytesIO(f"{good}\n{line}\n".encode()))
    code, out, err = write(capsys, "--database", db_url, "events", "-")
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1
    assert open_store(db_url).heads().get("events", 0) == 0


def test_a_line_that_is_not_utf8_is_named(db, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.BytesIO(b'["$e", "!r", "m", null, null]\n["\xff", "!r", "m", null, null]\n'))
    code, out, err = write(capsys, "--database", db, "events", "-")
    assert code == 2 and out == "" and "stdin line 2 is not valid UTF-8 at byte 3" in err
