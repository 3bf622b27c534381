"""Database URLs: ``sqlite:///relative.db``, ``sqlite:////absolute.db``, ``postgresql://...``."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

import attr

# scheme://user:PASSWORD@host: the password ends at the netloc's last "@".
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/?#@\s]*:)[^/?#\s]*@")
# password=SECRET in a libpq key=value DSN or a URL's query ('quoted' values too).
_KEY_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s&]*)", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with every password of a database URL or DSN in it replaced by ``***``.

    The one redaction for logs and error messages: ``postgresql://u:pw@h/db``
    becomes ``postgresql://u:***@h/db``, ``password=pw`` becomes
    ``password=***``; anything else is left as it is.
    """
    if "@" not in text and "assword" not in text.lower():
        return text
    text = _URL_PASSWORD.sub(r"\g<head>***@", text)
    return _KEY_PASSWORD.sub(r"\g<head>***", text)


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

    def __str__(self) -> str:
        """The URL for messages (without its password)."""
        return redact_url(self.text)


def parse_database_url(url: str, base_dir: str | None = None) -> DatabaseUrl:
    """Parse ``url``; relative SQLite paths are taken from ``base_dir`` (default: cwd)."""
    if not isinstance(url, str) or not url:
        raise BadDatabaseUrl(f"database URL must be a non-empty string, got {redact_url(repr(url))}")
    if "\x00" in url or not url.isprintable():
        raise BadDatabaseUrl(f"database URL {redact_url(repr(url))} contains control characters")
    if url.startswith("sqlite:"):
        if not url.startswith("sqlite:///") or url in ("sqlite:///", "sqlite:////"):
            raise BadDatabaseUrl(
                f"bad SQLite URL {redact_url(repr(url))}: use sqlite:///relative/path.db or sqlite:////absolute/path.db"
            )
        rest = url[len("sqlite:///") :]
        path = rest if rest.startswith("/") else os.path.join(base_dir or os.getcwd(), rest)
        return DatabaseUrl("sqlite", path=os.path.normpath(path), text=url)
    parts = urlsplit(url)
    if parts.scheme in ("postgresql", "postgres"):
        if not parts.hostname and not parts.path.strip("/"):
            raise BadDatabaseUrl(f"bad PostgreSQL URL {redact_url(repr(url))}: use postgresql://user@host:port/db")
        return DatabaseUrl("postgresql", dsn=url, text=url)
    raise BadDatabaseUrl(
        f"unsupported database URL {redact_url(repr(url))}: expected sqlite:///path.db or postgresql://user@host:port/db"
    )
