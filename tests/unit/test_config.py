"""Configuration: defaults, the sample config, and one clear message per bad key."""

from __future__ import annotations

import attr
import pytest

from replication.master import MasterConfig
from replication.protocol import ProtocolConfig
from replication.timeline_settings import TimelineSettings
from scripts.cli import main
from scripts.config import ConfigError, config_from_mapping, load_config
from workers.consumer import ApplySettings
from workers.worker import WorkerConfig

SAMPLE = "sample_config.yaml"


def test_no_file_means_every_default() -> None:
    config = load_config(None)
    assert config.master == MasterConfig()
    assert config.protocol == ProtocolConfig()
    assert config.master.listen_host == "127.0.0.1"
    assert set(config.streams) == {"events", "caches"}


def test_sample_config_loads_and_states_the_defaults() -> None:
    config = load_config(SAMPLE)
    assert config.master == MasterConfig()
    assert config.protocol == ProtocolConfig()
    assert "metrics" in config.streams
    text = open(SAMPLE).read()
    for cls in (ProtocolConfig, MasterConfig, WorkerConfig, ApplySettings):
        for field in attr.fields(cls):
            if field.name in ("listen_host", "listen_port", "master_host", "master_port", "apply"):
                continue
            if field.name == "start_at_ms":  # the key is worker.start_at
                assert "start_at:" in text
                continue
            assert f"{field.name}:" in text, f"sample_config.yaml does not document {field.name}"
    assert config.worker == WorkerConfig()
    assert config.timeline == TimelineSettings()
    for field in attr.fields(TimelineSettings):
        assert f"{field.name}:" in text, f"sample_config.yaml does not document timeline.{field.name}"


def test_values_are_taken() -> None:
    config = config_from_mapping(
        {"listen": "0.0.0.0:1234", "server_name": "s1", "protocol": {"ping_interval": 1, "max_line_bytes": 1000}}
    )
    assert (config.master.listen_host, config.master.listen_port) == ("0.0.0.0", 1234)
    assert config.master.server_name == "s1"
    assert config.protocol.ping_interval == 1.0 and config.protocol.max_line_bytes == 1000


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"colour": "blue"}, "colour: unknown key"),
        ({"protocol": {"ping_intervall": 5}}, "protocol.ping_intervall: unknown key"),
        ({"master": {"poll_interval": "fast"}}, "master.poll_interval: expected a positive number"),
        ({"protocol": {"max_line_bytes": True}}, "protocol.max_line_bytes: expected a positive whole number"),
        ({"protocol": {"max_line_bytes": 1.5}}, "protocol.max_line_bytes"),
        ({"protocol": "yes"}, "protocol: expected a mapping"),
        ({"server_name": "two words"}, "server_name: expected one word"),
        ({"listen": "localhost"}, "listen: expected HOST:PORT"),
        ({"listen": "localhost:http"}, "listen: port must be a number"),
        ({"listen": "localhost:70000"}, "listen: port 70000 is out of range"),
        ({"listen": ":80"}, "listen: missing host"),
        ({"database": "mysql://x/y"}, "database: unsupported database URL"),
        ({"database": 5}, "database: database URL must be a non-empty string"),
        ({"logging": {"level": "LOUD"}}, "logging.level: expected one of"),
        ({"streams": {"events": {"columns": [{"name": "a", "type": "text"}]}}}, "streams: stream 'events' is built in"),
        ({"streams": {"m": {"columns": [{"name": "a", "type": "varchar"}]}}}, "unknown type 'varchar'"),
        ({"streams": {"m": {"columns": []}}}, "'columns' must be a non-empty list"),
        ({"streams": {"m": {"columns": [{"name": "a"}]}}}, "needs 'name' and 'type'"),
        ({"streams": {"Bad": {"columns": [{"name": "a", "type": "text"}]}}}, "bad stream name"),
        ({"worker": {"replicate": ["nosuch"]}}, "worker.replicate: unknown stream 'nosuch'"),
        ({"worker": {"replicate": "events"}}, "worker.replicate: expected a list of names"),
        ({"worker": {"master": "nowhere"}}, "worker.master: expected HOST:PORT"),
        ({"worker": {"database": "oracle://x"}}, "worker.database: unsupported database URL"),
        ({"worker": {"handlers": ["a.b"]}}, "worker.handlers: expected a mapping"),
        ({"worker": {"handlers": {"nosuch": ["a.b"]}}}, "worker.handlers.nosuch: unknown stream"),
        ({"worker": {"apply_rows": 0}}, "worker.apply_rows: expected a positive whole number"),
        ({"worker": {"invalidate_caches": "yes"}}, "worker.invalidate_caches: expected true or false"),
        ({"worker": {"nme": "w"}}, "worker.nme: unknown key"),
        ({"caches": {"special": {"x": "a"}}}, "caches.special.x: expected a list of names"),
        ({"caches": {"max_size": -5}}, "caches.max_size: expected a positive whole number"),
        ({"caches": {"size": 5}}, "caches.size: unknown key"),
    ],
)
def test_bad_config_names_the_key(raw, key) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping(raw)
    assert key in str(e.value)


def test_bad_yaml_and_missing_file(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.yaml"))
    top_list = tmp_path / "list.yaml"
    top_list.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="config must be a mapping"):
        load_config(str(top_list))


def test_check_config_command(tmp_path, capsys) -> None:
    assert main(["check-config", "-c", SAMPLE]) == 0
    assert "OK" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("protocol:\n  ping_timeout: -1\n")
    assert main(["check-config", "-c", str(bad)]) == 2
    assert "protocol.ping_timeout" in capsys.readouterr().err


def test_worker_synchronous_commit_defaults_off_and_is_checked(tmp_path) -> None:
    from scripts.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("worker:\n  synchronous_commit: true\n")
    assert load_config(str(path)).worker.synchronous_commit is True
    path.write_text("worker: {}\n")
    assert load_config(str(path)).worker.synchronous_commit is False
    path.write_text("worker:\n  synchronous_commit: maybe\n")
    with pytest.raises(ConfigError, match="synchronous_commit"):
        load_config(str(path))


def test_worker_time_keys() -> None:
    config = config_from_mapping({"worker": {"ordered": False, "start_at": "2026-11-23T00:00:00Z"}})
    assert config.worker.ordered is False
    assert config.worker.start_at_ms == 1795392000000
    assert config_from_mapping({"worker": {"start_at": 1234}}).worker.start_at_ms == 1234
    assert config_from_mapping({"master": {"tick_interval": 0.05}}).master.tick_interval == 0.05


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"worker": {"ordered": "yes"}}, "worker.ordered: expected true or false"),
        ({"worker": {"start_at": "yesterday"}}, "worker.start_at: 'yesterday': expected Unix ms"),
        ({"worker": {"start_at": -5}}, "worker.start_at: -5: Unix milliseconds cannot be negative"),
        ({"master": {"tick_interval": 0}}, "master.tick_interval: expected a positive number"),
    ],
)
def test_bad_worker_time_keys(raw, message) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping(raw)
    assert message in str(e.value)
