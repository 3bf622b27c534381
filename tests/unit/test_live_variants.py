"""master._live_variants: the variants live subscriptions take, in order (False before True)."""

from __future__ import annotations

import itertools
from typing import Any, cast

import pytest

from replication.master import _live_variants


class Target:
    def __init__(self, with_ts: bool) -> None:
        self.with_ts = with_ts


@pytest.mark.parametrize("flags", [f for n in range(4) for f in itertools.product([False, True], repeat=n)])
def test_the_variants_are_the_sorted_set_of_the_subscriptions(flags: tuple[bool, ...]) -> None:
    subs = cast(Any, {Target(flag): None for flag in flags})
    assert _live_variants(subs) == tuple(sorted(set(flags)))
