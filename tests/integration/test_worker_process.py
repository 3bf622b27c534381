"""``tickline worker`` as a process: handlers from the config, caches, clean stop."""

from __future__ import annotations

import sqlite3

from tests.conftest import run_tickline
from tests.integration.procs import Proc, accepts, free_port, query_one, sqlite_url, wait_for


def test_config_handlers_and_cache_rows_reach_the_worker(tmp_path) -> None:
    master_db, worker_db = tmp_path / "m.db", tmp_path / "w.db"
    port = free_port()
    config = tmp_path / "tickline.yaml"
    config.write_text(
        f"database: {sqlite_url(master_db)}\n"
        f"listen: 127.0.0.1:{port}\n"
        "server_name: prod\n"
        "worker:\n"
        "  name: w1\n"
        f"  database: {sqlite_url(worker_db)}\n"
        "  server_name: prod\n"
        "  handlers:\n"
        "    events: [tests.integration.sample_handlers:count_rooms]\n"
        "    caches: [tests.integration.sample_handlers.record_invalidations]\n"
    )
    master = Proc(tmp_path / "master.log", "master", "-c", str(config))
    worker = None
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        worker = Proc(tmp_path / "worker.log", "worker", "-c", str(config), "--replicate", "events")
        assert run_tickline("write", "-c", str(config), "events", '["$a", "!r1", "t", null, null]').returncode == 0
        assert (
            run_tickline(
                "write",
                "-c",
                str(config),
                "--batch",
                "events",
                '["$b", "!r1", "t", null, null]',
                '["$c", "!r2", "t", null, null]',
            ).returncode
            == 0
        )
        assert (
            run_tickline(
                "write", "-c", str(config), "caches", '["members", ["!r1"], 1]', '["state", null, 2]'
            ).returncode
            == 0
        )
        wait_for(lambda: query_one(worker_db, "SELECT COUNT(*) FROM seen_invalidations", 0) == 2, 30, "invalidations")
        wait_for(
            lambda: query_one(worker_db, "SELECT token FROM tickline_applied WHERE stream='events'", 0) == 2,
            30,
            "events",
        )
    finally:
        code = worker.stop() if worker is not None else None
        master.stop()
    conn = sqlite3.connect(worker_db)
    assert dict(conn.execute("SELECT room_id, n FROM room_counts")) == {"!r1": 2, "!r2": 1}
    assert conn.execute("SELECT token, cache_name, keys FROM seen_invalidations ORDER BY token").fetchall() == [
        (1, "members", "['!r1']"),
        (2, "state", None),
    ]
    assert conn.execute("SELECT COUNT(*) FROM replicated_events").fetchone()[0] == 3
    assert code == 0


def test_worker_refuses_a_master_with_another_name_and_keeps_retrying(tmp_path) -> None:
    port = free_port()
    master = Proc(
        tmp_path / "master.log",
        "master",
        "--database",
        sqlite_url(tmp_path / "m.db"),
        "--listen",
        f"127.0.0.1:{port}",
        "--server-name",
        "staging",
    )
    worker = None
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        worker = Proc(
            tmp_path / "worker.log",
            "worker",
            "--name",
            "w1",
            "--master",
            f"127.0.0.1:{port}",
            "--database",
            sqlite_url(tmp_path / "w.db"),
            "--server-name",
            "prod",
            "--replicate",
            "events",
        )
        wait_for(lambda: worker.output().count("expected 'prod'") >= 2, 30, "two refused connections in the log")
        assert "wrong server" in master.output()
        assert query_one(tmp_path / "w.db", "SELECT COUNT(*) FROM tickline_applied", 0) == 0
    finally:
        if worker is not None:
            assert worker.stop() == 0
        master.stop()


def test_worker_waits_for_an_unreachable_master_then_connects(tmp_path) -> None:
    port = free_port()
    worker = Proc(
        tmp_path / "worker.log",
        "worker",
        "--name",
        "w1",
        "--master",
        f"127.0.0.1:{port}",
        "--database",
        sqlite_url(tmp_path / "w.db"),
        "--replicate",
        "events",
    )
    master = None
    try:
        wait_for(
            lambda: "cannot connect to the master" in worker.output(), 15, "the worker to report the refused connection"
        )
        master = Proc(
            tmp_path / "master.log",
            "master",
            "--database",
            sqlite_url(tmp_path / "m.db"),
            "--listen",
            f"127.0.0.1:{port}",
        )
        wait_for(lambda: "connected to master" in worker.output(), 30, "the worker to connect")
    finally:
        assert worker.stop() == 0
        if master is not None:
            master.stop()


def test_worker_bad_config_and_unknown_stream_are_clear_errors(tmp_path) -> None:
    result = run_tickline(
        "worker", "--name", "w1", "--database", sqlite_url(tmp_path / "w.db"), "--replicate", "nosuch"
    )
    assert result.returncode == 2 and "unknown stream 'nosuch'" in result.stderr
    config = tmp_path / "c.yaml"
    config.write_text("worker:\n  handlers:\n    events: [no.such.module:fn]\n")
    result = run_tickline("worker", "-c", str(config), "--database", sqlite_url(tmp_path / "w.db"))
    assert result.returncode == 2 and "cannot import no.such.module" in result.stderr
    result = run_tickline("worker", "--database", "sqlite:////nonexistent-dir/w.db", "--replicate", "events")
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_tail_and_worker_authenticate_with_the_configured_secret(tmp_path) -> None:
    master_db, worker_db = tmp_path / "m.db", tmp_path / "w.db"
    port = free_port()
    config = tmp_path / "secret.yaml"
    config.write_text(
        f"database: {sqlite_url(master_db)}\nlisten: 127.0.0.1:{port}\nsecret: s3cret\n"
        f"worker:\n  name: w1\n  database: {sqlite_url(worker_db)}\n  replicate: [events]\n"
    )
    master = Proc(tmp_path / "master.log", "master", "-c", str(config))
    worker = None
    try:
        wait_for(lambda: accepts(port), 15, "the master to listen")
        worker = Proc(tmp_path / "worker.log", "worker", "-c", str(config))
        assert run_tickline("write", "-c", str(config), "events", '["$a", "!r", "t", null, null]').returncode == 0
        tail = run_tickline("tail", "-c", str(config), "--from", "0", "--count", "1", "events", timeout=30)
        assert tail.returncode == 0, tail.stderr
        assert '"$a"' in tail.stdout
        wait_for(lambda: query_one(worker_db, "SELECT COUNT(*) FROM replicated_events", 0) == 1, 30, "the worker")
        # Without the secret the master refuses.
        plain = run_tickline(
            "tail", "--master", f"127.0.0.1:{port}", "--from", "0", "--count", "1", "events", timeout=30
        )
        assert plain.returncode == 1 and "authentication required" in plain.stderr
    finally:
        if worker is not None:
            assert worker.stop() == 0
        master.stop()
