"""Instants for tail --since and worker.start_at."""

from __future__ import annotations

import pytest

from scripts.when import BadInstant, iso_ms, parse_when

NOW = 1_800_000_000.0  # seconds


@pytest.mark.parametrize(
    "text, ms",
    [
        ("1700000000000", 1700000000000),
        (1700000000000, 1700000000000),
        ("2026-11-23T04:55:00Z", 1795409700000),
        ("2026-11-23T04:55:00", 1795409700000),
        ("2026-11-23 05:55:00.250+01:00", 1795409700250),
        ("-30s", 1_800_000_000_000 - 30_000),
        ("-5m", 1_800_000_000_000 - 300_000),
        ("-2h", 1_800_000_000_000 - 7_200_000),
        ("-1d", 1_800_000_000_000 - 86_400_000),
        ("-250ms", 1_800_000_000_000 - 250),
        ("-1.5s", 1_800_000_000_000 - 1500),
    ],
)
def test_instants(text, ms) -> None:
    assert parse_when(text, now=NOW) == ms


@pytest.mark.parametrize("text", ["", "yesterday", "-5", "-5x", "5m", "2026-13-01", -1, None, True])
def test_bad_instants(text) -> None:
    with pytest.raises(BadInstant):
        parse_when(text, now=NOW)


def test_iso() -> None:
    assert iso_ms(1795409700250) == "2026-11-23T04:55:00.250Z"
