"""Peer-supplied text made safe for a log line: one function, used everywhere.

A peer controls the text of its ``ERROR`` messages, ``NAME``, the arguments of
``REMOVE_PUSHER`` and every bad line it sends. Written to a log raw, that text
could end the log line and forge another one (``\\n``, ``\\r``, the Unicode line
and paragraph separators U+2028/U+2029, NEL U+0085), rewrite the terminal of
whoever reads the log (ANSI escape sequences start with ESC), or hide text
(bidirectional overrides). :func:`safe` escapes every such character the way
Python's ``repr`` does (``\\r``, ``\\x1b``, ``\\u2028``) and cuts the text to a
bounded length, so one log line stays one line of bounded size.

:class:`SafeFormatter` applies the same escaping to the whole message of every
log record, as a second line of defence for a call that forgot :func:`safe`.
"""

from __future__ import annotations

import logging
import unicodedata

# Longest peer text kept in one log line, in characters.
MAX_LOGGED_CHARS = 200

_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    short = _SHORT_ESCAPES.get(ch)
    if short is not None:
        return short
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _needs_escape(ch: str) -> bool:
    if " " <= ch <= "~":
        return False
    # Cc: C0/C1 controls (ESC, CR, LF, NEL...); Cf: format (bidi overrides,
    # zero-width); Zl/Zp: U+2028/U+2029; Cs: lone surrogates; Cn: unassigned.
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Cn", "Co")


def escape(text: str) -> str:
    """``text`` with every control, format and line-separator character escaped."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(_escape_char(ch) if _needs_escape(ch) else ch for ch in text)


def safe(text: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """Peer text for a log line: escaped, and at most ``limit`` characters of it.

    Bytes are decoded as UTF-8 with invalid bytes shown as ``\\xNN``. A cut
    text ends with ``...(N more chars)``. Escaping is idempotent: it never
    adds a character that would be escaped again.
    """
    if isinstance(text, bytes):
        text = text[: limit * 4].decode("utf-8", "backslashreplace")
    elif not isinstance(text, str):
        text = str(text)
    more = len(text) - limit
    if more > 0:
        return escape(text[:limit]) + f"...({more} more chars)"
    return escape(text)


class SafeFormatter(logging.Formatter):
    """Escapes the message of every record (not its traceback) before formatting.

    Tracebacks (``logger.exception``) keep their own lines; everything else is
    one line, whatever a peer managed to put into its arguments.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)
