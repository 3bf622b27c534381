"""The benchmark's row counts when ``--rows`` is not given (issue 11's table: catch-up of 500,000 rows)."""

from __future__ import annotations

from typing import Any

import pytest

from scripts import bench_pg, benchmark


@pytest.mark.parametrize(("rows", "expected"), [(None, 500_000), (3000, 3000)])
def test_the_catch_up_replays_500000_rows_unless_rows_are_given(monkeypatch, tmp_path, capsys, rows, expected) -> None:
    # The scenario itself takes minutes at 500,000 rows; only which count reaches it is checked here
    # (tests/test_benchmark_smoke.py runs it for real).
    seen: dict[str, Any] = {}

    def record(chosen: list[str], rows: int, workdir: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.update(rows=rows, catch_up_rows=kwargs.get("catch_up_rows"))
        return {}

    monkeypatch.setattr(bench_pg, "run", record)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert benchmark.main(["catch-up"], rows=rows, repeat=1) == 0
    assert seen == {"rows": rows or benchmark.DEFAULT_ROWS, "catch_up_rows": expected}
    header = capsys.readouterr().out.splitlines()[0]
    counted = "200,000 rows (catch-up 500,000)," if rows is None else "3,000 rows,"
    assert header.startswith(f"tickline bench: {counted} 1 runs per scenario"), header
