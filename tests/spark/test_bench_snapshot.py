"""The "snapshot" benchmark scenario runs end to end on a few rows (no timing is asserted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.bench_snapshot import print_results, run_snapshot_bench
from scripts.benchmark import SCENARIOS


def test_snapshot_scenario_prints_a_ratio_line_per_backend(
    spark, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert "snapshot" in SCENARIOS
    results = run_snapshot_bench(2000, 1, str(tmp_path), spark=spark)
    assert set(results) == {"snapshot-sqlite", "snapshot-postgresql"}
    print_results(results)
    out = capsys.readouterr().out
    for name in results:
        assert re.search(rf"^{name}: tickline [\d,]+ rows/s, baseline [\d,]+ rows/s, ratio \d+\.\d\d$", out, re.M), out
    assert "2,000 rows, 4 partitions" in out
    assert not spark.sparkContext._jsc.sc().isStopped()  # a session it was given is left running
