"""The layers keep to their contracts: no SQL above storage, no store typed ``Any``, storage imports nothing above it."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

SQL = re.compile(r"\b(SELECT|INSERT|CREATE|UPDATE|DELETE FROM)\b")
STORE_ANY = re.compile(r"\bstore\w*\s*:\s*Any\b")


def _sources(package: str) -> list[Path]:
    return sorted((Path(ROOT) / package).rglob("*.py"))


def test_no_sql_text_in_replication_or_workers() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in ("replication", "workers")
        for path in _sources(package)
        for n, line in enumerate(path.read_text("utf-8").splitlines(), 1)
        if SQL.search(line)
    ]
    assert found == []


def test_no_store_is_typed_any() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in ("replication", "workers", "storage", "scripts")
        for path in _sources(package)
        for n, line in enumerate(path.read_text("utf-8").splitlines(), 1)
        if STORE_ANY.search(line)
    ]
    assert found == []


def test_storage_imports_nothing_above_it() -> None:
    above = {"replication", "workers", "scripts", "twisted"}
    found = []
    for path in _sources("storage"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.relative_to(ROOT)}: {name}" for name in names if name.split(".")[0] in above]
    assert found == []


def test_one_redaction_function() -> None:
    """Passwords are masked by ``storage.urls.redact_url`` only (no second, diverging copy)."""
    found = [
        str(path.relative_to(ROOT))
        for package in ("replication", "storage", "workers", "scripts")
        for path in _sources(package)
        if "***" in path.read_text("utf-8") and path != Path(ROOT) / "storage" / "urls.py"
    ]
    assert found == []


def test_no_committed_logs() -> None:
    assert "*.log" in (Path(ROOT) / ".gitignore").read_text("utf-8").split()
    try:
        listed = subprocess.run(
            ["git", "ls-files", "*.log"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert listed.stdout == ""
