"""Database URLs: ``sqlite:///relative.db``, ``sqlite:////absolute.db``, ``postgresql://...``."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import attr


class BadDatabaseUrl(ValueError):
    """A database URL that names no database tickline can open."""


@attr.s(slots=True, frozen=True, auto_attribs=True)
class DatabaseUrl:
    scheme: str  # "sqlite" or "postgresql"
    path: str | None = None  # sqlite: absolute path of the file
    dsn: str | None = None  # postgresql: the URL as libpq takes it
    text: str = ""

    @property
    def is_sqlite(self) -> bool:
        return self.scheme == "sqlite"


def shown_url(url: str) -> str:
    """The URL for messages: its password (``user:secret@``) replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    return f"{scheme}{sep}{userinfo}{at}{host}"


def parse_database_url(url: str, base_dir: str | None = None) -> DatabaseUrl:
    """Parse ``url``; relative SQLite paths are taken from ``base_dir`` (default: cwd)."""
    if not isinstance(url, str) or not url:
        raise BadDatabaseUrl(f"database URL must be a non-empty string, got {type(url).__name__}")
    if "\x00" in url or not url.isprintable():
        raise BadDatabaseUrl(f"database URL {shown_url(url)!r} contains control characters")
    if url.startswith("sqlite:"):
        if not url.startswith("sqlite:///") or url in ("sqlite:///", "sqlite:////"):
            raise BadDatabaseUrl(
                f"bad SQLite URL {shown_url(url)!r}: use sqlite:///relative/path.db or sqlite:////absolute/path.db"
            )
        rest = url[len("sqlite:///") :]
        path = rest if rest.startswith("/") else os.path.join(base_dir or os.getcwd(), rest)
        return DatabaseUrl("sqlite", path=os.path.normpath(path), text=url)
    parts = urlsplit(url)
    if parts.scheme in ("postgresql", "postgres"):
        if not parts.hostname and not parts.path.strip("/"):
            raise BadDatabaseUrl(f"bad PostgreSQL URL {shown_url(url)!r}: use postgresql://user@host:port/db")
        return DatabaseUrl("postgresql", dsn=url, text=url)
    raise BadDatabaseUrl(
        f"unsupported database URL {shown_url(url)!r}: expected sqlite:///path.db or postgresql://user@host:port/db"
    )
