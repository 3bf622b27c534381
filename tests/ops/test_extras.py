"""``pip install tickline`` without extras runs a master and a worker on SQLite.

PostgreSQL (psycopg2) and Spark (pyspark) are the ``postgres`` and ``spark``
extras. Here both are made unimportable in the child processes (a
``sitecustomize`` that refuses them), and a master, ``tickline write``, a
worker and ``tickline tail`` still do their whole job; asking for PostgreSQL
then names the missing extra in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, wait_for_port
from tests.integration.procs import free_port, wait_for

BLOCKER = """
import sys

class _NoExtras:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("psycopg2", "pyspark"):
            raise ImportError(f"No module named {name!r} (blocked: extra not installed)")
        return None

sys.meta_path.insert(0, _NoExtras())
"""


def _env(tmp: Path) -> dict[str, str]:
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")


def _tickline(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scripts.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_master_write_worker_and_tail_run_without_postgres_and_spark(tmp_path: Path) -> None:
    env = _env(tmp_path)
    probe = _tickline(env, "--help")
    assert probe.returncode == 0, probe.stderr
    blocked = subprocess.run([sys.executable, "-c", "import psycopg2"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0  # the blocker works

    port = free_port()
    db = f"sqlite:///{tmp_path / 'master.db'}"
    master = subprocess.Popen(
        [sys.executable, "-m", "scripts.cli", "master", "--listen", f"127.0.0.1:{port}", "--database", db],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = None
    outputs: dict[str, str] = {}
    try:
        wait_for_port("127.0.0.1", port, process=master)
        written = _tickline(env, "write", "--database", db, "events", '["$a", "!r", "t", null, null]')
        assert written.returncode == 0, written.stderr
        worker_db = tmp_path / "worker.db"
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scripts.cli",
                "worker",
                "--name",
                "w1",
                "--master",
                f"127.0.0.1:{port}",
                "--database",
                f"sqlite:///{worker_db}",
                "--replicate",
                "events",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        tail = _tickline(env, "tail", "--master", f"127.0.0.1:{port}", "--from", "0", "--count", "1", "events")
        assert tail.returncode == 0, tail.stderr
        assert '"$a"' in tail.stdout

        def applied() -> bool:
            import sqlite3

            if not worker_db.exists():
                return False
            try:
                with sqlite3.connect(worker_db) as conn:
                    return conn.execute("SELECT count(*) FROM replicated_events").fetchone()[0] == 1
            except sqlite3.Error:
                return False

        wait_for(applied, 30, "the worker to apply the row")
    finally:
        for role, proc in (("worker", worker), ("master", master)):
            if proc is not None:
                proc.terminate()
                outputs[role] = proc.communicate(timeout=30)[1]
    assert master.returncode == 0
    assert "Traceback" not in outputs["master"]
    assert "Traceback" not in outputs["worker"]


def test_postgres_without_its_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    env = _env(tmp_path)
    result = _tickline(env, "write", "--database", "postgresql://u:hunter2@127.0.0.1:1/db", "events", "[]")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "tickline[postgres]" in lines[0]
    assert "hunter2" not in result.stderr


def test_snapshot_without_spark_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    env = _env(tmp_path)
    worker_db = tmp_path / "worker.db"
    result = _tickline(env, "snapshot", "--database", f"sqlite:///{worker_db}", "--stream", "events")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "tickline[spark]" in lines[0] and "pyspark" in lines[0]
    assert not worker_db.exists()  # nothing was created on the way


def test_snapshot_of_postgres_without_its_extra_names_it_without_the_password(tmp_path: Path) -> None:
    env = _env(tmp_path)
    # Reading a snapshot's bounds needs no Spark: the missing psycopg2 is what fails.
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from storage.schema import Column, StreamSchema\n"
            "from workers.snapshot import SnapshotError, read_bounds\n"
            "try:\n"
            "    read_bounds('postgresql://u:hunter2@127.0.0.1:1/db', StreamSchema('s', (Column('a', 'text'),)))\n"
            "except SnapshotError as e:\n"
            "    print(e)\n",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "tickline[postgres]" in result.stdout
    assert "hunter2" not in result.stdout + result.stderr
