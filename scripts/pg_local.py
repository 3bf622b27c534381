"""A throwaway PostgreSQL server on loopback, for tests and benchmarks.

``initdb`` and ``postgres`` refuse to run as root, so the server runs as the
``postgres`` user (through ``runuser`` when we are root) in a temporary data
directory under /tmp that this user can enter, listening on 127.0.0.1 on a
free port, with fsync off.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PG_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
START_TIMEOUT = 30.0


def pg_bin(name: str) -> str | None:
    """The path of a PostgreSQL server program, or None when it is not installed."""
    for directory in PG_BIN_DIRS:
        candidate = directory / name
        if candidate.exists():
            return str(candidate)
    return shutil.which(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """``durable``: fsync and synchronous commit on (benchmarks); ``logical``: ``wal_level=logical``."""

    def __init__(self, durable: bool = False, logical: bool = False) -> None:
        self.durable = durable
        self.logical = logical
        self.port = _free_port()
        self.user = "postgres"
        self.datadir = Path(tempfile.mkdtemp(prefix="tickline-pg-", dir="/tmp"))
        self._as_root = os.geteuid() == 0
        self._counter = itertools.count()
        self._databases: list[str] = []  # made by new_database, not dropped yet

    def _run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        command = list(args)
        if self._as_root:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, **kwargs)

    def start(self) -> None:
        initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise RuntimeError("PostgreSQL server binaries not found: run ./scripts/setup.sh (installs postgresql)")
        if self._as_root:
            pw = pwd.getpwnam(self.user)
            os.chown(self.datadir, pw.pw_uid, pw.pw_gid)
        else:
            self.user = pwd.getpwuid(os.geteuid()).pw_name
        data = str(self.datadir / "data")
        result = self._run(initdb, "--no-sync", "-A", "trust", "-U", "postgres", "-E", "UTF8", "-D", data)
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed: {result.stderr}")
        options = f"-p {self.port} -k {self.datadir} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not self.durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        if self.logical:
            options += " -c wal_level=logical -c max_wal_senders=10 -c max_replication_slots=10"
        self._options = options
        self._launch()

    def restart(self) -> None:
        """Stop the server (dropping every connection) and start it again, same port and data."""
        self._run(self._pg_ctl(), "-D", str(self.datadir / "data"), "-m", "fast", "-w", "stop")
        self._launch()

    def _launch(self) -> None:
        pg_ctl, data, options = self._pg_ctl(), str(self.datadir / "data"), self._options
        result = self._run(
            pg_ctl, "-D", data, "-o", options, "-l", str(self.datadir / "log"), "-w", "-t", "30", "start"
        )
        if result.returncode != 0:
            log = (self.datadir / "log").read_text(errors="replace") if (self.datadir / "log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {result.stderr}\n{log}")
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("PostgreSQL did not accept connections") from None
                time.sleep(0.05)

    @staticmethod
    def _pg_ctl() -> str:
        pg_ctl = pg_bin("pg_ctl")
        if pg_ctl is None:
            raise RuntimeError("PostgreSQL server binaries not found: run ./scripts/setup.sh (installs postgresql)")
        return pg_ctl

    def stop(self) -> None:
        pg_ctl = pg_bin("pg_ctl")
        if pg_ctl is not None:
            self._run(pg_ctl, "-D", str(self.datadir / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.datadir, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        import psycopg2

        name = f"t{os.getpid()}_{next(self._counter)}"
        conn = psycopg2.connect(self.url())
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        conn.close()
        self._databases.append(name)
        return self.url(name)

    def drop_databases(self) -> None:
        """Drop the databases :meth:`new_database` made, their sessions ended (``WITH (FORCE)``).

        A benchmark's runs each make their own: without this the cluster grows with every run
        (hundreds of MB for a catch-up's), and the later runs slow down.
        """
        import psycopg2

        conn = psycopg2.connect(self.url())
        conn.autocommit = True
        with conn.cursor() as cur:
            while self._databases:
                cur.execute(f"DROP DATABASE IF EXISTS {self._databases[-1]} WITH (FORCE)")
                self._databases.pop()
        conn.close()
