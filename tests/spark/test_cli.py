"""``tickline snapshot``: Parquet output read back by Spark, and the errors that need no Spark."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, run_tickline
from tests.spark.conftest import SAMPLE, SAMPLE_CONFIG, SimulatedWorker, as_tuples, expected_rows
from tests.stores import sqlite_worker_store
from workers.snapshot import snapshot


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "tickline.yaml"
    path.write_text(SAMPLE_CONFIG + "spark:\n  num_partitions: 3\n", encoding="utf-8")
    return path


def run_in_process(args: list[str], capsys: pytest.CaptureFixture) -> subprocess.CompletedProcess:
    """``tickline ARGS`` in this process, beside the tests' SparkSession (which it then uses and leaves running)."""
    from scripts.cli import build_parser
    from scripts.config import load_config
    from scripts.snapshot import run_snapshot

    parsed = build_parser().parse_args(args)
    capsys.readouterr()
    code = run_snapshot(parsed, load_config(parsed.config))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


# The real program (its own JVM, ~10-20 s) once; the incremental case in-process (seconds).
@pytest.mark.parametrize(
    "worker_url, incremental, separate_process",
    [("sqlite", False, True), ("postgresql", True, False)],
    ids=["sqlite-snapshot-program", "postgresql-incremental-in-process"],
    indirect=["worker_url"],
)
def test_out_writes_parquet_that_reads_back_as_the_snapshot(
    spark,
    worker: SimulatedWorker,
    config_file: Path,
    tmp_path: Path,
    incremental: bool,
    separate_process: bool,
    capsys: pytest.CaptureFixture,
) -> None:
    worker.fill(400)
    worker.start()  # the worker keeps writing while the command runs
    worker.wait_for(450)
    out = tmp_path / "out"
    args = ["-c", str(config_file), "--database", worker.url, "--stream", "sample", "--out", str(out)]
    if incremental:
        args += ["--after", "100"]
    if separate_process:
        proc = run_tickline("snapshot", *args, timeout=180)
    else:
        proc = run_in_process(["snapshot", *args], capsys)
    worker.stop()
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    token = result["token"]
    after = 100 if incremental else 0
    assert token >= 450 and result["stream"] == "sample" and result["partitions"] == 3
    assert result.get("after") == (100 if incremental else None)
    directory = out / f"sample_{after}_{token}"
    assert result["out"] == str(directory)
    assert "starting Spark" in proc.stderr

    written = spark.read.parquet(str(directory))
    rows = written.collect()
    assert result["rows"] == len(rows)
    assert as_tuples(rows) == expected_rows(after + 1, token)
    same = snapshot(spark, worker.url, "sample", SAMPLE, as_of=token).dataframe.where(f"token > {after}")
    assert as_tuples(rows) == as_tuples(same.collect())
    assert dict(written.dtypes)["ts"] == "bigint"

    manifest = json.loads((directory / "_manifest.json").read_text())
    assert (manifest["stream"], manifest["after"], manifest["token"], manifest["rows"]) == (
        "sample",
        after,
        token,
        len(rows),
    )
    assert manifest["incremental"] is incremental
    assert [c["name"] for c in manifest["columns"]] == ["token", "instance_name", "ts", *SAMPLE.column_names]
    assert len(manifest["files"]) == 3 and all((directory / f).exists() for f in manifest["files"])
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_existing_output_is_refused(worker: SimulatedWorker, config_file: Path, tmp_path: Path) -> None:
    worker.fill(5)
    (tmp_path / "out" / "sample_0_5").mkdir(parents=True)
    proc = run_tickline(
        "snapshot",
        "-c",
        str(config_file),
        "--database",
        worker.url,
        "--stream",
        "sample",
        "--out",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 2
    assert "sample_0_5 already exists" in proc.stderr


def test_errors_are_clear_and_need_no_spark(pg_server, config_file: Path, tmp_path: Path) -> None:
    db = tmp_path / "w.db"
    url = f"sqlite:///{db}"
    w = SimulatedWorker(url)
    w.fill(20)
    w.stop()
    bare = SimulatedWorker(f"sqlite:///{tmp_path / 'bare.db'}", SAMPLE)  # a worker db ...
    sqlite_worker_store(bare.store).database.write(
        lambda conn: conn.execute("DROP TABLE replicated_sample")
    )  # ... that replicates nothing
    bare.stop()
    base = ["snapshot", "-c", str(config_file)]
    cases = [
        ([*base, "--database", url, "--stream", "nosuch"], "unknown stream 'nosuch'"),
        (
            [*base, "--database", url, "--stream", "sample", "--as-of", "21"],
            "token 21 is above the worker's applied token 20",
        ),
        ([*base, "--database", url, "--stream", "sample", "--after", "25"], "after token 25 is above"),
        ([*base, "--database", url, "--stream", "sample", "--partitions", "0"], "--partitions must be at least 1"),
        ([*base, "--database", f"sqlite:///{tmp_path}/absent.db", "--stream", "sample"], "no SQLite database at"),
        (
            [*base, "--database", f"sqlite:///{tmp_path}/bare.db", "--stream", "sample"],
            "has no table replicated_sample: the worker does not replicate stream 'sample'",
        ),
        (
            [*base, "--database", f"postgresql://postgres@127.0.0.1:{free_port()}/nope", "--stream", "sample"],
            "cannot connect to PostgreSQL at",
        ),
        ([*base, "--database", pg_server.url("postgres"), "--stream", "sample"], "is not a worker's database"),
        ([*base, "--database", "mysql://x/y", "--stream", "sample"], "unsupported database URL"),
    ]
    for args, message in cases:
        proc = run_tickline(*args, timeout=30)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr, (args, proc.stderr)
        assert "starting Spark" not in proc.stderr and proc.stdout == ""
    both = run_tickline(*base, "--database", url, "--stream", "sample", "--as-of", "3", "--after", "1")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    assert not (tmp_path / "absent.db").exists()


def test_spark_config_section() -> None:
    import attr

    from scripts.config import ConfigError, config_from_mapping, load_config
    from workers.snapshot import SparkSettings

    assert load_config(None).spark == SparkSettings()
    sample = load_config(str(ROOT / "sample_config.yaml"))
    assert sample.spark == SparkSettings()
    text = (ROOT / "sample_config.yaml").read_text()
    assert all(f"  {f.name}:" in text for f in attr.fields(SparkSettings))
    custom = config_from_mapping({"spark": {"num_partitions": 8, "fetchsize": 500, "sqlite_jar": "/opt/s.jar"}})
    assert (custom.spark.num_partitions, custom.spark.fetchsize, custom.spark.sqlite_jar) == (8, 500, "/opt/s.jar")
    for raw, message in [
        ({"spark": {"partitions": 2}}, "spark.partitions: unknown key"),
        ({"spark": {"num_partitions": 0}}, "spark.num_partitions: expected a positive whole number"),
        ({"spark": "yes"}, "spark: expected a mapping"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_mapping(raw)
