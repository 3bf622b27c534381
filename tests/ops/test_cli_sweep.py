"""A sweep of the CLI with bad arguments, configs and inputs, as real processes.

Every case must end with exit code 2 and exactly one line on stderr, never a
traceback, and nothing written to the database.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_tickline

EVENT = '["$e", "!r", "t", null, null]'

# name -> file contents (bytes); "$DB" stands for the test's database URL.
CONFIGS: dict[str, bytes] = {
    "utf8": b"server_name: caf\xe9\n",
    "yaml": b"listen: [unclosed\n",
    "deep": b"streams: " + b"[" * 50_000 + b"]" * 50_000 + b"\n",
    "inf": b"master:\n  poll_interval: .inf\n",
    "tiny": b"master:\n  poll_interval: 1e-300\n",
    "nan": b"protocol:\n  ping_timeout: .nan\n",
    "negative": b"worker:\n  reconnect_max: -5\n",
    "huge": b"protocol:\n  max_line_bytes: 99999999999999999999\n",
    "keyword": b"streams:\n  m:\n    columns:\n      - {name: order, type: text}\n",
    "secret": b"secret: hunter2 with spaces\n",
    "not_mapping": b"- a\n- b\n",
    "unknown_key": b"masterr: {}\n",
    "small_lines": b"database: $DB\nprotocol:\n  max_line_bytes: 600\n",
}

CASES: list[tuple[str, ...]] = [
    ("master", "-c", "@utf8"),
    ("master", "-c", "@yaml"),
    ("master", "-c", "@deep"),
    ("master", "-c", "@inf"),
    ("master", "-c", "@tiny"),
    ("master", "-c", "@nan"),
    ("master", "-c", "@huge"),
    ("master", "-c", "@keyword"),
    ("master", "-c", "@secret"),
    ("master", "-c", "@not_mapping"),
    ("master", "-c", "@unknown_key"),
    ("master", "-c", "/nonexistent/tickline.yaml"),
    ("master", "--listen", "nowhere"),
    ("master", "--listen", "127.0.0.1:99999"),
    ("master", "--database", "mysql://admin:hunter2@db/x"),
    ("master", "--database", "sqlite:////nonexistent-dir/x.db"),
    ("master", "--server-name", "two words"),
    ("master", "--bogus"),
    ("write", "--database", "$DB", "events", "[1"),
    ("write", "--database", "$DB", "events", '["$e"]'),
    ("write", "--database", "$DB", "events", '["$e", "!r", 5, null, null]'),
    ("write", "--database", "$DB", "events", '["$e", "!r", "t", null, null, {"a": 1}]'),
    ("write", "--database", "$DB", "events", "[" * 3000 + "]" * 3000),
    ("write", "--database", "$DB", "events", "-", "<deep"),
    ("write", "--database", "$DB", "events", "-", "<utf8"),
    ("write", "--database", "$DB", "events", "-", "<bad_late"),
    ("write", "--database", "$DB", "events", "-", "<empty"),
    ("write", "--database", "$DB", "events", "-", "-"),
    ("write", "--database", "$DB", "nosuch", EVENT),
    ("write", "--database", "$DB", "--instance", "two words", "events", EVENT),
    ("write", "--database", "$DB", "--instance", "x" * 300, "events", EVENT),
    ("write", "-c", "@small_lines", "events", '["' + "x" * 600 + '", "!r", "t", null, null]'),
    ("write", "-c", "@inf", "events", EVENT),
    ("write", "--database", "$DB", "events"),
    ("write", "--database", "$DB", "events", '{"nope": 1}'),
    ("write", "--database", "$DB", "events", '"a string"'),
    ("write", "--database", "mysql://x/y", "events", EVENT),
    ("tail", "--count", "-1", "events"),
    ("tail", "--count", "many", "events"),
    ("tail", "--from", "-5", "events"),
    ("tail", "--master", "nowhere", "events"),
    ("tail", "-c", "@utf8", "events"),
    ("tail",),
    ("worker", "--master", "nowhere"),
    ("worker", "--database", "mysql://x/y"),
    ("worker", "-c", "@secret"),
    ("worker", "-c", "@negative"),
    ("worker", "--name", "two words"),
    ("worker", "--replicate", "nosuch", "--database", "$WDB"),
    ("snapshot",),
    ("snapshot", "--stream", "events", "--partitions", "0"),
    ("snapshot", "--stream", "events", "--as-of", "-1"),
    ("snapshot", "--stream", "events", "--as-of", "1", "--after", "0"),
    ("snapshot", "-c", "@yaml", "--stream", "events"),
    ("check-config", "-c", "@utf8"),
    ("check-config", "-c", "@deep"),
    ("check-config", "-c", "@keyword"),
    ("check-config", "-c", "@secret"),
    ("check-config", "-c", "@tiny"),
    ("check-config", "-c", "/nonexistent.yaml"),
    ("check-config",),
    ("bench", "--rows", "0"),
    ("bench", "--rows", "lots"),
    ("bench", "no-such-scenario"),
    ("nosuch-command",),
    (),
]

STDIN: dict[str, bytes] = {
    "deep": b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "utf8": b'["$e", "\xc3\x28", "t", null, null]\n',
    "bad_late": (EVENT + "\n").encode() * 3000 + b'["$e", "!r", "t", null, null, 7]\n',
    "empty": b"\n\n",
}


def _resolve(args: tuple[str, ...], tmp_path: Path) -> tuple[list[str], bytes | None]:
    db = f"sqlite:///{tmp_path}/t.db"
    resolved, stdin = [], None
    for arg in args:
        if arg.startswith("@"):
            path = tmp_path / f"{arg[1:]}.yaml"
            path.write_bytes(CONFIGS[arg[1:]].replace(b"$DB", db.encode()))
            arg = str(path)
        elif arg.startswith("<"):
            stdin = STDIN[arg[1:]]
            continue
        resolved.append(arg.replace("$WDB", f"sqlite:///{tmp_path}/w.db").replace("$DB", db))
    return resolved, stdin


@pytest.mark.parametrize("args", CASES, ids=[" ".join(a)[:60] or "(none)" for a in CASES])
def test_bad_input_is_one_line_exit_2_no_traceback(args, tmp_path) -> None:
    argv, stdin = _resolve(args, tmp_path)
    result = run_tickline(*argv, input=stdin if stdin is not None else b"", timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (argv[:6], result.returncode, result.stderr[-2000:])
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("tickline"), lines[0]
    assert "hunter2" not in result.stderr  # secrets and passwords are never echoed
    assert result.stdout == "" or args[0] == "bench"
    if args and args[0] == "write" and (tmp_path / "t.db").exists():
        from storage.store import open_store

        store = open_store(f"sqlite:///{tmp_path}/t.db")
        assert store.heads().get("events", 0) == 0  # nothing was written
        store.close()
