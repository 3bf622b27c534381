"""A worker's start path imports only what it needs: a catch-up after a restart waits for every import."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

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


# `tickline worker` through the command line's main(), the daemon's loop replaced as above.
_CLI = """
import sys
import scripts.daemon

ran = []
scripts.daemon.run_daemon = lambda *args: ran.append(args) or 0
from scripts.cli import main

argv = ["worker", "--name", "w", "--master", "127.0.0.1:9", "--database", "sqlite:///" + sys.argv[1]]
assert main(argv + ["--replicate", "events"] + sys.argv[2:]) == 0 and ran
kept_out = [
    m for m in ("OpenSSL", "cryptography", "service_identity", "twisted.internet.ssl", "yaml", "workers.snapshot", "workers.timeline",
                "replication.timeline_commands")
    if m not in sys.modules
]
print(" ".join(kept_out) or "none")
"""


def test_worker_without_tls_or_config_file_keeps_their_modules_out(tmp_path) -> None:
    # pyOpenSSL with Twisted's TLS modules (about 0.1 s of a start; see replication.tls) and
    # YAML come only with TLS or a config file; the snapshot's, the timeline consumer's and the timeline's commands
    # only when used. TLS after such a start: tests/wire/test_wire_tls.py.
    out = subprocess.run(
        [sys.executable, "-c", _CLI, str(tmp_path / "worker.db")], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "OpenSSL", "cryptography", "service_identity", "twisted.internet.ssl", "yaml", "workers.snapshot", "workers.timeline",
        "replication.timeline_commands",
    ]  # fmt: skip


# `tickline worker` through main(), as _CLI, but nothing imported before main() does: the daemon's
# loop is replaced as its module loads. Then: which of the modules no worker uses were run.
_LAZY = """
import importlib.machinery
import sys

ran = []


class ReplaceTheDaemonsLoop:
    def find_spec(self, name, path=None, target=None):
        if name != "scripts.daemon":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.run_daemon = lambda *args: ran.append(args) or 0

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, ReplaceTheDaemonsLoop())
from scripts.cli import main

argv = ["worker", "--name", "w", "--master", "127.0.0.1:9", "--database", "sqlite:///" + sys.argv[1]]
assert main(argv + ["--replicate", "events"]) == 0 and ran
from scripts.lazy_modules import UNUSED_BY_A_WORKER

print(" ".join(m for m in UNUSED_BY_A_WORKER if type(sys.modules.get(m)).__name__ != "_LazyModule") or "none")
print(" ".join(m for m in ("random", "pickle") if type(sys.modules.get(m)).__name__ == "_LazyModule") or "none")
"""


def test_worker_start_leaves_the_modules_no_worker_uses_unrun(tmp_path) -> None:
    # Imported by Twisted and asyncio, bound to a name and used only inside functions: about
    # 13 ms of a start (scripts.lazy_modules). A 100,000-row catch-up left them unrun too
    # (docs/benchmarks.md, wstart3); a use runs them (test_worker_start.py).
    out = subprocess.run(
        [sys.executable, "-c", _LAZY, str(tmp_path / "worker.db")], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "none"


def test_worker_start_leaves_random_and_pickle_ordinary_modules(tmp_path) -> None:
    # A user's handlers may take them up first from several threads at once, and Python 3.11's
    # LazyLoader runs a module on first use without a lock: the other threads would see it
    # half made (AttributeError). So they are not among the lazy ones (scripts.lazy_modules).
    out = subprocess.run(
        [sys.executable, "-c", _LAZY, str(tmp_path / "worker.db")], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1] == "none"


def test_worker_with_tls_configured_imports_twisted_tls_as_usual(tmp_path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca"],
        cwd=tmp_path, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    config = tmp_path / "worker.yaml"
    config.write_text(f"tls:\n  ca: {tmp_path / 'ca.pem'}\n")
    out = subprocess.run(
        [sys.executable, "-c", _CLI, str(tmp_path / "worker.db"), "-c", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "workers.snapshot",
        "workers.timeline",
        "replication.timeline_commands",
    ]  # TLS, YAML came


def test_the_postgresql_worker_store_does_not_import_the_masters_reading_modules() -> None:
    # pg_worker's non-blocking connection comes from storage.pg_nonblocking, not pg_wake (which
    # brings pg_store and pg_lines: about 2 ms of every worker start).
    code = "import sys, storage.pg_worker; print(' '.join(m for m in sys.modules if m.startswith('storage.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    imported = set(out.stdout.split())
    assert "storage.pg_nonblocking" in imported
    assert not imported & {"storage.pg_wake", "storage.pg_store", "storage.pg_lines"}
