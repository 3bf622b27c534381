"""The test session's throwaway PostgreSQL server (see ``scripts/pg_local.py``).

Each test that asks for ``pg_url`` gets a database of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scripts.pg_local import PostgresServer


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_url(pg_server: PostgresServer) -> str:
    """The URL of a fresh, empty database on the session's server."""
    return pg_server.new_database()
