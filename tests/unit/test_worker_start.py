"""A worker's start: the store opened on a thread while Twisted is imported, lazy modules, one command's parser."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest

from scripts.cli import COMMANDS, build_parser
from scripts.lazy_modules import lazy_modules
from scripts.worker_start import SetupThread
from tests.conftest import ROOT, run_tickline

# -- one command's parser --------------------------------------------------------------

ARGVS = [
    ["master", "--listen", "127.0.0.1:1", "--database", "sqlite:///m.db", "--metrics-listen", "9"],
    ["write", "--batch", "events", "[1]", "-"],
    ["tail", "--from", "5", "--count", "2", "--since=-5m", "--ts", "events", "caches"],
    ["worker", "--name", "w", "--master", "h:1", "--replicate", "events", "--replicate", "caches"],
    ["worker"],
    ["snapshot", "--stream", "events", "--as-of", "7", "--partitions", "3"],
    ["check-config", "-c", "x.yaml"],
    ["timeline", "schedule", "--at", "+5s", "--group", "g", "topic", "{}"],
    ["timeline", "list", "--status", "waiting", "topic"],
    ["bench", "catch-up", "--rows", "10", "--repeat", "1", "-v"],
]


@pytest.mark.parametrize("argv", ARGVS, ids=[" ".join(a) for a in ARGVS])
def test_one_commands_parser_parses_as_the_whole_command_line(argv) -> None:
    assert argv[0] in COMMANDS
    assert vars(build_parser(argv[0]).parse_args(argv)) == vars(build_parser().parse_args(argv))


@pytest.mark.parametrize("command", COMMANDS)
def test_one_commands_parser_has_that_commands_help(command) -> None:
    def help_of(parser) -> str:
        (subparsers,) = [a for a in parser._actions if a.dest == "command"]
        return subparsers.choices[command].format_help()

    assert help_of(build_parser(command)) == help_of(build_parser())
    (subparsers,) = [a for a in build_parser(command)._actions if a.dest == "command"]
    assert list(subparsers.choices or ()) == [command]  # only that command's parser was built


def test_errors_name_the_command_as_before(capsys) -> None:
    for parser in (build_parser("worker"), build_parser()):
        with pytest.raises(SystemExit) as exit:
            parser.parse_args(["worker", "--bogus"])
        assert exit.value.code == 2
    first, second = capsys.readouterr().err.splitlines()
    assert first == second == "tickline: error: unrecognized arguments: --bogus (see tickline --help)"


# -- the set-up thread ------------------------------------------------------------------


def test_setup_thread_runs_calls_in_order_and_raises_their_errors_in_the_caller() -> None:
    thread = SetupThread("test-setup")
    seen: list[str] = []

    def note(what: str, result: int) -> int:
        seen.append(what)
        return result

    first = thread.submit(lambda: note(threading.current_thread().name, 1))
    assert thread.call(note, "second", 2) == 2
    assert first.result() == 1 and seen == ["test-setup", "second"]
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 / 0)
    assert thread.call(lambda: 3) == 3  # an error does not end the thread
    thread.end()
    thread._thread.join(5)
    assert not thread._thread.is_alive()


# -- lazy modules --------------------------------------------------------------------------


def test_a_lazy_module_runs_when_first_used(tmp_path, monkeypatch) -> None:
    (tmp_path / "lazy_probe_module.py").write_text("import sys\nsys.lazy_probe_ran = True\nVALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_probe_module", raising=False)
    try:
        with lazy_modules(["lazy_probe_module"]):
            import lazy_probe_module
        assert not hasattr(sys, "lazy_probe_ran")  # imported, not run
        assert lazy_probe_module.VALUE == 42
        assert sys.lazy_probe_ran is True  # type: ignore[attr-defined]
    finally:
        sys.modules.pop("lazy_probe_module", None)
        if hasattr(sys, "lazy_probe_ran"):
            del sys.lazy_probe_ran


# -- errors as before ------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_handler_that_cannot_be_loaded_is_reported_before_an_unreachable_database(tmp_path) -> None:
    # As before the store was opened on its own thread: the handlers are loaded first.
    config = tmp_path / "worker.yaml"
    config.write_text("worker:\n  handlers:\n    events: [no_such_module_here:handle]\n")
    url = f"postgresql://postgres@127.0.0.1:{_closed_port()}/nowhere"
    result = run_tickline("worker", "-c", str(config), "--database", url, "--master", "127.0.0.1:9", timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tickline worker: error: worker.handlers: handler 'no_such_module_here:handle'"), line


def test_an_unreachable_database_is_reported_as_before(tmp_path) -> None:
    url = f"postgresql://postgres@127.0.0.1:{_closed_port()}/nowhere"
    result = run_tickline("worker", "--database", url, "--master", "127.0.0.1:9", timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("tickline worker: error: cannot connect to PostgreSQL at postgresql://"), line


def test_a_worker_start_does_not_run_http_cookiejar(tmp_path) -> None:
    # twisted.python.compat imports http.cookiejar (with urllib.request, http.client, email: about
    # 12 ms); a worker never uses it, so its start leaves it unrun (scripts.lazy_modules). The start
    # stops at the unreachable database, after every import of a start.
    url = f"postgresql://postgres@127.0.0.1:{_closed_port()}/nowhere"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "scripts.cli", "worker", "--database", url, "--master", "h:9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "twisted.internet.reactor" in imported and "http.cookiejar" in imported
    assert not {"urllib.request", "http.client", "email.parser"} & imported
    # numpy (~140 ms): only a master's reads on PostgreSQL use it (storage.pg_columns_out, which a
    # worker no longer imports at all: its non-blocking connection comes from storage.pg_nonblocking).
    assert "storage.pg_worker" in imported
    assert not {"numpy", "storage.pg_columns_out", "storage.pg_wake"} & imported


@pytest.mark.parametrize(
    "config_text, flags",
    [
        ("worker:\n  handlers:\n    events: [no_such_module_here:handle]\n", []),
        ("", ["--metrics-listen", "bogus:x:y"]),
    ],
    ids=["bad handler", "bad metrics address"],
)
def test_a_start_that_stops_before_prepare_ends_its_setup_thread(tmp_path, capsys, config_text, flags) -> None:
    # In one process (as a caller of scripts.cli.main would): the set-up thread that opened the
    # store must not stay parked on its queue holding the store once the start has failed.
    from scripts.cli import main

    config = tmp_path / "worker.yaml"
    config.write_text(config_text or "worker: {}\n")
    before = set(threading.enumerate())
    argv = ["worker", "-c", str(config), "--database", f"sqlite:///{tmp_path}/w.db", "--master", "127.0.0.1:9"]
    assert main([*argv, *flags]) == 2
    assert "tickline worker: error:" in capsys.readouterr().err
    setup = [t for t in set(threading.enumerate()) - before if t.name.endswith("-setup")]
    for thread in setup:
        thread.join(10)
    assert not [t for t in setup if t.is_alive()]
