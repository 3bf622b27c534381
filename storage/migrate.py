"""Versioned migrations: ``migrations/NNNN_name.sql`` applied in order, once each."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIGRATION_FILE = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")


def migrations() -> list[tuple[int, str, str]]:
    """(version, file name, SQL) of every migration shipped, in order."""
    found = []
    # The package's folder itself: importlib.resources would import zipfile (about 25 ms of CPU
    # at every start of a worker or master) for an installation that is never a zip file.
    for entry in (Path(__file__).parent / "migrations").iterdir():
        match = MIGRATION_FILE.fullmatch(entry.name)
        if match:
            found.append((int(match.group(1)), entry.name, entry.read_text("utf-8")))
    return sorted(found)


def split_statements(sql: str) -> list[str]:
    """The statements of a migration file (``;`` ends a statement; ``--`` comments)."""
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def apply_migrations(
    execute: Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]],
    placeholder: str,
) -> list[int]:
    """Apply the missing migrations inside the caller's (write-locked) transaction.

    ``execute(sql, params)`` runs one statement and returns its rows.
    Returns the versions applied.
    """
    execute(
        "CREATE TABLE IF NOT EXISTS tickline_schema_version (version INTEGER PRIMARY KEY, name TEXT NOT NULL)",
        (),
    )
    done = {row[0] for row in execute("SELECT version FROM tickline_schema_version", ())}
    applied = []
    for version, name, sql in migrations():
        if version in done:
            continue
        for statement in split_statements(sql):
            execute(statement, ())
        execute(
            f"INSERT INTO tickline_schema_version (version, name) VALUES ({placeholder}, {placeholder})",
            (version, name),
        )
        applied.append(version)
    return applied
