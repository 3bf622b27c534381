"""A worker's start path imports only what it needs: a catch-up after a restart waits for every import."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

# Builds a worker as `tickline worker` does (store opened, tables made) up to
# the daemon's loop, which is replaced: what is imported by then is what every
# start of a worker without metrics pays for.
_CODE = """
import sys
import scripts.run_worker as rw
from scripts.cli import build_parser
from scripts.config import load_config

ran = []
rw.run_daemon = lambda *args: ran.append(args) or 0
args = build_parser().parse_args(
    ["worker", "--name", "w", "--master", "127.0.0.1:9", "--database", "sqlite:///" + sys.argv[1], "--replicate", "events"]
)
assert rw.run_worker(args, load_config(None)) == 0 and ran
heavy = [m for m in sys.modules if m.split(".")[0] == "prometheus_client" or m.startswith("twisted.web")]
print(" ".join(sorted(heavy)) or "none")
"""


def test_worker_without_metrics_does_not_import_the_metrics_endpoint(tmp_path) -> None:
    # twisted.web and prometheus_client take about 0.1 s to import; they come only with
    # metrics configured (tests/ops/test_metrics.py runs a worker that serves them).
    out = subprocess.run(
        [sys.executable, "-c", _CODE, str(tmp_path / "worker.db")], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["none"]
