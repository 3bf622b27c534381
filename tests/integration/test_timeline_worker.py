"""A worker consuming a timeline topic with a handler (``worker.timeline``), as real processes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.procs import Proc, wait_for

CONFIG = """
listen: 127.0.0.1:{port}
database: {database}
worker:
  name: tw
  database: sqlite:///{tmp}/worker.db
  timeline:
    topic: jobs
    handler: tests.integration.timeline_handlers:handle
    credit: 2
    lease_ms: 1000
    backoff_initial_ms: 300
    backoff_max_ms: 2000
"""


def _notes(out: Path) -> list[dict]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def test_worker_deletes_releases_with_backoff_and_extends(master, tmp_path: Path, tickline) -> None:
    m = master()
    config = tmp_path / "w.yaml"
    config.write_text(CONFIG.format(port=m.port, database=m.database, tmp=tmp_path))
    out = tmp_path / "notes.jsonl"
    body = {"out": str(out)}
    wire = ["--master", m.address]
    assert tickline("timeline", "schedule", *wire, "jobs", "--id", "ok", json.dumps(body)).returncode == 0
    assert (
        tickline("timeline", "schedule", *wire, "jobs", "--id", "flaky", json.dumps({**body, "fail": 2})).returncode
        == 0
    )
    assert (
        tickline("timeline", "schedule", *wire, "jobs", "--id", "slow", json.dumps({**body, "sleep": 2.2})).returncode
        == 0
    )
    worker = Proc(tmp_path / "worker.log", "worker", "-c", str(config))
    try:
        wait_for(lambda: sum(n["what"] == "done" for n in _notes(out)) == 3, 20, "three handled messages")
        notes = _notes(out)
        flaky = [n for n in notes if n["id"] == "flaky"]
        assert [n["what"] for n in flaky] == ["raised", "raised", "done"]
        # Released with 300 ms, then 600 ms: exponential backoff between attempts.
        assert flaky[1]["at"] - flaky[0]["at"] >= 0.3
        assert flaky[2]["at"] - flaky[1]["at"] >= 0.6
        # The slow one ran once, past its 1 s lease (extended at half), and was not handed out again.
        assert [n["what"] for n in notes if n["id"] == "slow"] == ["done"]
        wait_for(
            lambda: json.loads(tickline("timeline", "stats", "--database", m.database, "jobs").stdout)["total"] == 0,
            10,
            "every message deleted",
        )
        log = worker.output()
        assert "timeline jobs message flaky failed (attempt 1 here), released for 300 ms" in log
        assert "attempt 2 here), released for 600 ms" in log
        assert "RuntimeError: failing flaky on purpose" in log
        assert "lease is lost" not in log
    finally:
        assert worker.stop() == 0


def test_bad_worker_timeline_config_is_one_line(tickline, tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("worker:\n  timeline:\n    topic: jobs\n    credit: 2\n")
    out = tickline("check-config", "-c", str(config))
    assert out.returncode == 2 and "worker.timeline.handler: missing" in out.stderr
    config.write_text("worker:\n  timeline:\n    handler: no.such.module:f\n    topic: nope\n")
    out = tickline("worker", "-c", str(config))
    assert out.returncode == 2 and "worker.timeline: unknown topic 'nope'" in out.stderr
    config.write_text("worker:\n  timeline:\n    handler: no.such.module:f\n")
    out = tickline("worker", "-c", str(config))
    assert out.returncode == 2 and "cannot import no.such.module" in out.stderr
