"""Instants as people write them: Unix milliseconds, ISO-8601, or relative to now.

Used by ``tickline tail --since`` and the ``worker.start_at`` key.

* ``1700000000000``: Unix milliseconds.
* ``2026-11-23T04:55:00Z``, ``2026-11-23 04:55:00.250+01:00``: ISO-8601; a
  time without a zone is UTC (a server's logs and ``ts`` are UTC).
* ``-30s``, ``-5m``, ``-2h``, ``-1d``, ``-250ms``: that long before now.
"""

from __future__ import annotations

import datetime
import re
import time

_RELATIVE = re.compile(r"-(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class BadInstant(ValueError):
    """Text that is no instant; the message says what is accepted."""


def parse_when(text: object, now: float | None = None) -> int:
    """The Unix milliseconds of ``text`` (see the module doc)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise BadInstant(f"{text}: Unix milliseconds cannot be negative")
        return text
    if not isinstance(text, str) or not text.strip():
        raise BadInstant(f"{text!r}: expected Unix ms, ISO-8601 or a relative time like -5m")
    value = text.strip()
    if value.isdigit():
        return int(value)
    match = _RELATIVE.fullmatch(value)
    if match:
        now_ms = (time.time() if now is None else now) * 1000
        return max(0, int(now_ms - float(match.group(1)) * _UNITS_MS[match.group(2)]))
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise BadInstant(
            f"{value!r}: expected Unix ms (1700000000000), ISO-8601 (2026-11-23T04:55:00Z) "
            "or a relative time (-30s, -5m, -2h, -1d)"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    ms = round(parsed.timestamp() * 1000)
    if ms < 0:
        raise BadInstant(f"{value!r} is before 1970")
    return ms


def iso_ms(unix_ms: int) -> str:
    """ISO-8601 in UTC with milliseconds: ``2026-11-23T04:55:00.250Z``."""
    moment = datetime.datetime.fromtimestamp(unix_ms / 1000, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{unix_ms % 1000:03d}Z"
