"""Fixtures shared by tickline's tests: a real master process, the CLI, line sockets.

Everything here works on real TCP sockets on 127.0.0.1 and waits on events
(a connect that succeeds, a line that arrives, a process that exits) with
bounded deadlines, never on a bare sleep.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from storage.contracts import StreamStore

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
START_TIMEOUT = 10.0  # seconds a master may take to accept connections
LINE_TIMEOUT = 5.0  # default wait for one line from a socket
CLI_TIMEOUT = 60.0  # a CLI run that takes longer than this is a hang


def tickline_command() -> list[str]:
    """How to run the ``tickline`` program: the venv's entry point, else ``-m scripts.cli``."""
    script = Path(sys.executable).parent / "tickline"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "scripts.cli"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"  # an absolute path gives sqlite:////abs/path.db


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("JOURNAL_STREAM", None)
    return env


def run_tickline(
    *args: str, input: str | bytes | None = None, timeout: float = CLI_TIMEOUT, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``tickline ARGS...`` to completion; stdout and stderr as text."""
    if isinstance(input, str):
        input = input.encode("utf-8")
    proc = subprocess.run(
        [*tickline_command(), *args],
        input=input,
        capture_output=True,
        timeout=timeout,
        cwd=cwd or ROOT,
        env=_env(),
    )
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    )


# -- a line-oriented socket client ---------------------------------------------


class ConnectionClosed(AssertionError):
    """The peer closed the connection while a line was expected."""


class LineClient:
    """A blocking client that speaks lines, with a deadline on every read."""

    def __init__(self, host: str, port: int, timeout: float = LINE_TIMEOUT) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.timeout = timeout
        self._buffer = b""
        self.closed = False  # the peer closed (EOF or reset) while we read

    # sending
    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, *lines: str) -> None:
        self.sock.sendall(b"".join(line.encode("utf-8") + b"\n" for line in lines))

    # receiving
    def _fill(self, deadline: float) -> bool:
        """Read once; False on timeout. Raises ConnectionClosed on EOF/reset."""
        if self.closed:
            raise ConnectionClosed("connection closed by peer")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return False
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        if not data:
            self.closed = True
            raise ConnectionClosed("connection closed by peer")
        self._buffer += data
        return True

    def read_line(self, timeout: float | None = None) -> str:
        """The next line without its ``\\n``; AssertionError after ``timeout``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while b"\n" not in self._buffer:
            if not self._fill(deadline):
                raise AssertionError(f"no line within the timeout (partial: {self._buffer[:200]!r})")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8")

    def try_line(self, timeout: float) -> str | None:
        """The next line, or ``None`` if none arrives within ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if not self._fill(deadline):
                return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8")

    def read_until(
        self, predicate: Callable[[str], bool], timeout: float | None = None, limit: int = 1_000_000
    ) -> list[str]:
        """Lines up to and including the first matching ``predicate``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        lines = []
        for _ in range(limit):
            line = self.read_line(max(deadline - time.monotonic(), 0.0))
            lines.append(line)
            if predicate(line):
                return lines
        raise AssertionError(f"no matching line among {limit} lines")

    def expect(self, prefix: str, timeout: float | None = None, skip_pings: bool = True) -> str:
        """The next line that is not a PING (unless asked) must start with ``prefix``."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for _ in range(10_000):
            line = self.read_line(max(deadline - time.monotonic(), 0.0))
            if skip_pings and line.startswith("PING ") and not prefix.startswith("PING"):
                continue
            assert line.startswith(prefix), f"expected {prefix!r}, got {line!r}"
            return line
        raise AssertionError("only PINGs arrived")

    def next_command(self, timeout: float | None = None) -> str:
        """The next line that is not a PING."""
        return self.expect("", timeout)

    def handshake(self) -> tuple[str, str]:
        """Read the master's opening ``SERVER`` and ``PING`` lines."""
        server = self.read_line()
        ping = self.read_line()
        assert server.startswith("SERVER "), server
        assert ping.startswith("PING "), ping
        return server, ping

    def wait_closed(self, timeout: float = LINE_TIMEOUT) -> list[str]:
        """Read until the peer closes; returns the complete lines read meanwhile."""
        deadline = time.monotonic() + timeout
        lines: list[str] = []
        try:
            while True:
                if not self._fill(deadline):
                    raise AssertionError(f"connection still open after {timeout} s; got {lines[-5:]!r}")
                while b"\n" in self._buffer:
                    line, _, self._buffer = self._buffer.partition(b"\n")
                    lines.append(line.decode("utf-8", "replace"))
        except ConnectionClosed:
            while b"\n" in self._buffer:
                line, _, self._buffer = self._buffer.partition(b"\n")
                lines.append(line.decode("utf-8", "replace"))
            return lines

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def wait_for_port(
    host: str, port: int, timeout: float = START_TIMEOUT, process: subprocess.Popen | None = None
) -> None:
    """Poll connect until something accepts on ``host:port`` (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with code {process.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing accepted connections on {host}:{port} within {timeout} s") from None
            time.sleep(0.02)  # polling interval, not synchronization


# -- a master process ----------------------------------------------------------------


class MasterProcess:
    """A ``tickline master`` running as a subprocess."""

    def __init__(
        self,
        workdir: Path,
        config: str | None,
        args: Sequence[str],
        database: str | None,
        server_name: str | None,
        options: bool = True,
    ) -> None:
        self.host = HOST
        self.port = free_port()
        self.workdir = workdir
        self.database = database or sqlite_url(workdir / "tickline.db")
        self.config_path: Path | None = None
        if config is not None:
            # $PORT and $DATABASE in the config stand for this master's own.
            config = config.replace("$PORT", str(self.port)).replace("$DATABASE", self.database)
            self.config_path = workdir / "tickline.yaml"
            self.config_path.write_text(config, encoding="utf-8")
        self.server_name = server_name
        self.log_path = workdir / "master.log"
        self._clients: list[LineClient] = []
        self._store: StreamStore | None = None
        command = [*tickline_command(), "master"]
        if self.config_path is not None:
            command += ["-c", str(self.config_path)]
        if options:  # else the config file must give listen and database
            command += ["--listen", f"{self.host}:{self.port}", "--database", self.database]
        if server_name is not None:
            command += ["--server-name", server_name]
        command += list(args)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir, env=_env())
        try:
            wait_for_port(self.host, self.port, process=self.process)
        except Exception:
            self.stop()
            raise RuntimeError(f"master did not start; its log:\n{self.log()}") from None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def config_args(self) -> list[str]:
        return ["-c", str(self.config_path)] if self.config_path is not None else []

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text("utf-8", "replace")

    def wait_for_log(self, text: str, timeout: float = LINE_TIMEOUT) -> str:
        """Wait (bounded) until the master's log contains ``text``."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.log()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in the master's log within {timeout} s:\n{log}")
            time.sleep(0.02)
        return log

    def connect(self, timeout: float = LINE_TIMEOUT) -> LineClient:
        """A line client to this master, closed when the master is stopped."""
        client = LineClient(self.host, self.port, timeout)
        self._clients.append(client)
        return client

    def write(
        self, stream: str, *rows: str, batch: bool = False, instance: str | None = None, input: str | None = None
    ) -> list[int]:
        """``tickline write`` into this master's database; returns the printed tokens."""
        args = [*self.config_args(), "--database", self.database]
        if batch:
            args.append("--batch")
        if instance is not None:
            args += ["--instance", instance]
        result = run_tickline("write", *args, stream, *rows, input=input)
        assert result.returncode == 0, result.stderr
        return [int(line) for line in result.stdout.split()]

    def append(self, stream: str, rows: list, batch: bool = False, instance: str = "writer") -> list[int]:
        """Append rows from this (the test) process through the storage API; returns tokens."""
        if self._store is None:
            from storage.store import open_store

            self._store = open_store(self.database)
        return self._store.append(stream, rows, instance, batch=batch)

    def memory_kib(self, field: str = "VmHWM") -> int:
        """A memory figure of the master from /proc (VmHWM: peak resident set)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        if self._store is not None and hasattr(self._store, "close"):
            self._store.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Callable[..., MasterProcess]]:
    """Factory: ``master(config_yaml=None, *extra_args, database=None, server_name=None, options=True)``.

    Starts ``tickline master`` on a free port of 127.0.0.1 and a SQLite database
    in ``tmp_path`` and waits (polling connect, bounded) until it accepts
    connections. The config text may use ``$PORT`` and ``$DATABASE``; with
    ``options=False`` no ``--listen``/``--database`` is passed, so the config
    must give them. The returned object has ``host``, ``port``, ``address``,
    ``database`` (URL), ``config_path``, ``connect()``, ``write()`` (the CLI),
    ``append()`` (in-process storage API), ``log()`` and ``memory_kib()``.
    Every master is stopped (SIGTERM, then SIGKILL) at teardown.
    """
    started: list[MasterProcess] = []

    def start(
        config: str | None = None,
        *args: str,
        database: str | None = None,
        server_name: str | None = None,
        options: bool = True,
    ) -> MasterProcess:
        workdir = tmp_path / f"master{len(started)}"
        workdir.mkdir()
        proc = MasterProcess(workdir, config, args, database, server_name, options)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def tickline() -> Callable[..., subprocess.CompletedProcess]:
    """Run ``tickline ARGS...``: ``tickline("tail", "--master", ...)``."""
    return run_tickline


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start ``tickline ARGS...`` in the background (stdout/stderr piped); killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [*tickline_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=_env()
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)


@pytest.fixture
def unused_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just now)."""
    return free_port()


@pytest.fixture
def write() -> Callable[..., subprocess.CompletedProcess]:
    """``write(*args, input=None)`` runs ``tickline write ARGS...`` and returns the result."""

    def write(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
        return run_tickline("write", *args, input=input)

    return write


@pytest.fixture
def connect() -> Iterator[Callable[..., LineClient]]:
    """Factory ``connect(master_or_host, port=None)`` for line clients closed at teardown."""
    clients: list[LineClient] = []

    def open_client(target, port: int | None = None, timeout: float = LINE_TIMEOUT) -> LineClient:
        if port is None:
            host, port = target.host, target.port
        else:
            host = target
        client = LineClient(host, port, timeout)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()


@pytest.fixture
def nc_path() -> str:
    path = shutil.which("nc")
    if path is None:
        pytest.skip("nc (netcat-openbsd) is not installed")
    return path


pytest_plugins = ["tests.pgserver"]


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path: Path) -> str:
    """A fresh database on each backend: tests that take it run on both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/t.db"
    return request.getfixturevalue("pg_url")
