"""Fixtures for the Spark tests: one local[2] SparkSession for the whole run, worker databases.

The session is built by ``workers.snapshot.spark_session`` (127.0.0.1, the
Debian JDBC jars through ``spark.jars``); starting it costs ~5-8 s, so every
Spark test shares it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from storage.schema import Column, StreamSchema
from storage.worker_store import ApplyTransaction, open_worker_store
from workers.handlers import ApplyContext, ReplicatedRow
from workers.replicator import table_replicator

# Every column type, nullable and not.
SAMPLE = StreamSchema(
    "sample",
    (
        Column("name", "text"),
        Column("amount", "bigint"),
        Column("score", "double", nullable=True),
        Column("flag", "boolean", nullable=True),
        Column("payload", "json", nullable=True),
        Column("note", "text", nullable=True),
    ),
)
SAMPLE_CONFIG = """\
streams:
  sample:
    columns:
      - {name: name, type: text}
      - {name: amount, type: bigint}
      - {name: score, type: double, nullable: true}
      - {name: flag, type: boolean, nullable: true}
      - {name: payload, type: json, nullable: true}
      - {name: note, type: text, nullable: true}
"""
TS_BASE = 2**63 - 10**9  # timestamps that need all 64 bits (a double would round them)


def row_values(token: int, i: int) -> tuple[Any, ...]:
    """The columns of row ``i`` of ``token``: deterministic, with nulls sprinkled in."""
    k = token * 10 + i
    return (
        f"n{k}",
        (-1) ** k * (2**62 + k),
        None if k % 4 == 0 else k / 8,
        None if k % 5 == 0 else k % 2 == 0,
        None if k % 3 == 0 else {"k": k, "tags": [str(k), "x"]},
        None if k % 2 else f"note {k}",
    )


def rows_for(token: int) -> list[ReplicatedRow]:
    """1 to 3 rows per token (several rows may share one token)."""
    return [
        ReplicatedRow("sample", token, f"w{token % 2}", TS_BASE + token * 7 + i, row_values(token, i))
        for i in range(1 + token % 3)
    ]


def expected_rows(first: int, last: int) -> list[tuple[Any, ...]]:
    """(token, instance_name, ts, *columns) of tokens first..last, JSON as parsed objects."""
    return sorted(
        ((r.token, r.instance_name, r.ts, *r.values) for t in range(first, last + 1) for r in rows_for(t)),
        key=lambda t: (t[0], t[2]),
    )


def as_tuples(rows: list[Any]) -> list[tuple[Any, ...]]:
    """Spark rows of the sample stream as comparable tuples (JSON text parsed, key order free)."""
    import json

    out = []
    for r in rows:
        payload = None if r["payload"] is None else json.loads(r["payload"])
        out.append(
            (r["token"], r["instance_name"], r["ts"], r["name"], r["amount"], r["score"], r["flag"], payload, r["note"])
        )
    return sorted(out, key=lambda t: (t[0], t[2]))


class SimulatedWorker:
    """Applies tokens of the sample stream as a worker does: the table replicator's rows and
    the applied token in one transaction (``WorkerStore.apply``)."""

    def __init__(self, url: str, schema: StreamSchema = SAMPLE) -> None:
        self.url = url
        self.schema = schema
        self.store = open_worker_store(url)
        self.store.create_replicated_table(schema)
        self.handler = table_replicator(schema)
        self.applied = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def apply(self, token: int, rows: list[ReplicatedRow] | None = None) -> None:
        rows = rows_for(token) if rows is None else rows
        store = self.store

        def effects(txn: ApplyTransaction) -> None:
            self.handler(ApplyContext(txn, self.schema.name, self.schema, "w"), rows)

        store.apply(self.schema.name, token, effects)
        self.applied = token

    def fill(self, last: int) -> None:
        for token in range(self.applied + 1, last + 1):
            self.apply(token)

    def start(self, pause: float = 0.002) -> SimulatedWorker:
        """Keep applying the next token in a thread until :meth:`stop`."""

        def run() -> None:
            try:
                while not self._stop.is_set():
                    self.apply(self.applied + 1)
                    time.sleep(pause)
            except BaseException as e:  # reported by stop()
                self.error = e
            finally:
                self.store.close()

        self._thread = threading.Thread(target=run, name="simulated-worker", daemon=True)
        self._thread.start()
        return self

    def wait_for(self, token: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.applied < token:
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                raise AssertionError(f"the simulated worker did not reach token {token} in {timeout} s")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
            self._thread = None
        else:
            self.store.close()
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from workers.snapshot import spark_session

    session = spark_session("local[2]", app_name="tickline-tests", quiet=True)
    yield session
    session.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def worker_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh worker database URL on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path.resolve() / 'worker.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def worker(worker_url: str) -> Iterator[SimulatedWorker]:
    w = SimulatedWorker(worker_url)
    yield w
    w.stop()
