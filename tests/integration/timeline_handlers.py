"""Timeline handlers for the worker tests: each appends what it did to the file named in the body."""

from __future__ import annotations

import json
import time
from pathlib import Path

from workers.timeline import TimelineJob


def _note(job: TimelineJob, what: str) -> None:
    with open(job.body["out"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": job.id, "what": what, "version": job.version, "at": time.time()}) + "\n")


def handle(job: TimelineJob) -> None:
    """Sleeps ``body.sleep`` seconds; raises while ``body.fail`` earlier attempts are not reached."""
    attempts = Path(job.body["out"] + "." + job.id)
    done = int(attempts.read_text()) if attempts.exists() else 0
    attempts.write_text(str(done + 1))
    if done < job.body.get("fail", 0):
        _note(job, "raised")
        raise RuntimeError(f"failing {job.id} on purpose")
    time.sleep(job.body.get("sleep", 0))
    _note(job, "done")
