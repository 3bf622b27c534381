"""Bad configuration, as an operator meets it: ``tickline check-config``, ``master`` and ``worker``.

``tests/unit/test_config.py`` covers most keys through ``config_from_mapping``;
here are the classes it does not (metrics addresses, the logging section,
keys that belong elsewhere), and every class once more through the real
program: exit code 2 and one line on stderr naming the key.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from scripts.config import ConfigError, config_from_mapping
from tests.conftest import ROOT, run_tickline
from tests.integration.procs import free_port, sqlite_url

# -- classes not covered by tests/unit/test_config.py -----------------------------------


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"metrics_listen": "nowhere"}, "metrics_listen: expected HOST:PORT, got 'nowhere'"),
        ({"metrics_listen": "127.0.0.1:http"}, "metrics_listen: port must be a number, got 'http'"),
        ({"metrics_listen": 70000}, "metrics_listen: port 70000 is out of range 0-65535"),
        ({"metrics_listen": ":9100"}, "metrics_listen: missing host in ':9100'"),
        ({"metrics_listen": True}, "metrics_listen: expected HOST:PORT, got True"),
        ({"worker": {"metrics_listen": "nowhere"}}, "worker.metrics_listen: expected HOST:PORT"),
        ({"worker": {"metrics_listen": "127.0.0.1:99999"}}, "worker.metrics_listen: port 99999 is out of range"),
        ({"logging": {"format": "json"}}, "logging.format: unknown key (known: level)"),
        ({"logging": "DEBUG"}, "logging: expected a mapping"),
        ({"master": {"listen_host": "0.0.0.0"}}, "master.listen_host: unknown key"),  # it is the top-level listen
        ({"master": {"server_name": "x"}}, "master.server_name: unknown key"),  # top level too
        ({"secret": 5}, "secret: expected one word of printable ASCII"),
        ({"instance_name": "two words"}, "instance_name: expected one word"),
        ({"worker": {"name": "two words"}}, "worker.name: expected one word"),
        ({"worker": {"master": "127.0.0.1:99999"}}, "worker.master: port 99999 is out of range"),
        ({"worker": {"reconnect_max": -1}}, "worker.reconnect_max: expected a positive number, got -1"),
        ({"worker": {"max_pending_rows": 0}}, "worker.max_pending_rows: expected a positive whole number"),
        ({"worker": "w1"}, "worker: expected a mapping"),
        ({"streams": ["metrics"]}, "streams: expected a mapping"),
        ({"caches": {"special": ["a"]}}, "caches.special: expected a mapping"),
        ({"caches": {"max_size": 1.5}}, "caches.max_size: expected a positive whole number"),
    ],
)
def test_more_bad_keys_are_named(raw, message) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping(raw)
    assert message in str(e.value)


def test_metrics_addresses_and_log_level_are_taken() -> None:
    assert config_from_mapping({}).metrics_listen is None  # /metrics is off by default
    assert config_from_mapping({}).worker_metrics_listen is None
    assert config_from_mapping({"metrics_listen": 9100}).metrics_listen == ("127.0.0.1", 9100)
    assert config_from_mapping({"metrics_listen": "9100"}).metrics_listen == ("127.0.0.1", 9100)
    assert config_from_mapping({"metrics_listen": "0.0.0.0:9100"}).metrics_listen == ("0.0.0.0", 9100)
    assert config_from_mapping({"metrics_listen": "[::1]:9100"}).metrics_listen == ("::1", 9100)
    both = config_from_mapping({"metrics_listen": 9100, "worker": {"metrics_listen": 9101}})
    assert (both.metrics_listen, both.worker_metrics_listen) == (("127.0.0.1", 9100), ("127.0.0.1", 9101))
    assert config_from_mapping({"logging": {"level": "debug"}}).log_level == "DEBUG"
    assert config_from_mapping({"logging": None}).log_level == "INFO"


# -- through the real program ---------------------------------------------------------


def one_error_line(stderr: str, prefix: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def test_check_config_ok_prints_the_file_and_exits_0(tmp_path) -> None:
    sample = ROOT / "sample_config.yaml"
    result = run_tickline("check-config", "-c", str(sample))
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{sample}: OK\n", "")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")  # every key is optional
    assert run_tickline("check-config", "-c", str(empty)).returncode == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ("colour: blue\n", "colour: unknown key"),
        ("metrics_listen: nowhere\n", "metrics_listen: expected HOST:PORT"),
        ("worker:\n  metrics_listen: 127.0.0.1:99999\n", "worker.metrics_listen: port 99999 is out of range"),
        ("logging:\n  level: LOUD\n", "logging.level: expected one of DEBUG, INFO, WARNING, ERROR, got 'LOUD'"),
        ("protocol:\n  ping_timeout: -1\n", "protocol.ping_timeout: expected a positive number"),
        ("- a\n- b\n", "config must be a mapping of keys, got list"),
    ],
)
def test_check_config_bad_file_exits_2_with_one_line_naming_the_key(tmp_path, text, message) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = run_tickline("check-config", "-c", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert message in one_error_line(result.stderr, "tickline check-config: error: ")


def test_check_config_bad_yaml_says_where(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("listen: [unclosed\n")
    result = run_tickline("check-config", "-c", str(path))
    assert result.returncode == 2
    # One line: PyYAML's explanation and where the problem is.
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"tickline check-config: error: config file {path} is not valid YAML: ")
    assert line.endswith("at line 2, column 1"), result.stderr


def test_check_config_missing_file_or_option(tmp_path) -> None:
    missing = run_tickline("check-config", "-c", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2
    line = one_error_line(missing.stderr, "tickline check-config: error: ")
    assert f"cannot read config file {tmp_path / 'nope.yaml'}: No such file or directory" in line
    no_option = run_tickline("check-config")
    assert no_option.returncode == 2
    assert "the following arguments are required: -c/--config" in no_option.stderr


MASTER_CASES = [
    ("colour: blue\n", "colour: unknown key"),
    ("metrics_listen: nowhere\n", "metrics_listen: expected HOST:PORT"),
    ("logging:\n  level: LOUD\n", "logging.level: expected one of"),
    ("listen: 127.0.0.1:99999\n", "listen: port 99999 is out of range"),
    ("protocol:\n  max_line_bytes: 1.5\n", "protocol.max_line_bytes: expected a positive whole number"),
    ("master:\n  poll_interval: fast\n", "master.poll_interval: expected a positive number"),
    ("database: mysql://x/y\n", "database: unsupported database URL"),
]


@pytest.mark.parametrize("text, message", MASTER_CASES)
def test_master_with_a_bad_config_exits_2_naming_the_key(tmp_path, text, message) -> None:
    path = tmp_path / "master.yaml"
    path.write_text(text)
    result = run_tickline("master", "-c", str(path), timeout=20)
    assert result.returncode == 2
    assert message in one_error_line(result.stderr, "tickline master: error: ")


WORKER_CASES = [
    ("worker:\n  metrics_listen: nowhere\n", "worker.metrics_listen: expected HOST:PORT"),
    ("worker:\n  master: nowhere\n", "worker.master: expected HOST:PORT"),
    ("worker:\n  apply_rows: 0\n", "worker.apply_rows: expected a positive whole number"),
    ("worker:\n  nme: w1\n", "worker.nme: unknown key"),
    ("worker:\n  replicate: [nosuch]\n", "worker.replicate: unknown stream 'nosuch'"),
    ("logging:\n  level: LOUD\n", "logging.level: expected one of"),
]


@pytest.mark.parametrize("text, message", WORKER_CASES)
def test_worker_with_a_bad_config_exits_2_naming_the_key(tmp_path, text, message) -> None:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    result = run_tickline("worker", "-c", str(path), "--database", sqlite_url(tmp_path / "w.db"), timeout=20)
    assert result.returncode == 2
    assert message in one_error_line(result.stderr, "tickline worker: error: ")


def test_bad_metrics_listen_flags_exit_2(tmp_path) -> None:
    master = run_tickline(
        "master",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--database",
        sqlite_url(tmp_path / "m.db"),
        "--metrics-listen",
        "nowhere",
        timeout=20,
    )
    assert master.returncode == 2
    assert "--metrics-listen: expected HOST:PORT, got 'nowhere'" in one_error_line(
        master.stderr, "tickline master: error: "
    )
    worker = run_tickline(
        "worker", "--database", sqlite_url(tmp_path / "w.db"), "--metrics-listen", "99999", timeout=20
    )
    assert worker.returncode == 2
    assert "--metrics-listen: port 99999 is out of range" in one_error_line(worker.stderr, "tickline worker: error: ")


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port another socket listens on, for as long as the block runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        yield taken.getsockname()[1]


# (command, its arguments with BUSY for the taken port's address): every address a daemon listens on.
TAKEN_PORTS = {
    "master --metrics-listen": ("master", "--listen", "FREE", "--metrics-listen", "BUSY"),
    "master --listen": ("master", "--listen", "BUSY"),
    "worker --metrics-listen": ("worker", "--name", "w", "--master", "FREE", "--metrics-listen", "BUSY"),
}


@pytest.mark.parametrize("case", sorted(TAKEN_PORTS))
def test_a_daemon_whose_port_is_taken_exits_2_with_a_message(tmp_path, case) -> None:
    command = TAKEN_PORTS[case][0]
    with taken_port() as busy:
        addresses = {"BUSY": f"127.0.0.1:{busy}", "FREE": f"127.0.0.1:{free_port()}"}
        args = [addresses.get(arg, arg) for arg in TAKEN_PORTS[case]]
        result = run_tickline(*args, "--database", sqlite_url(tmp_path / f"{command}.db"), timeout=30)
    assert result.returncode == 2
    # A master logs its other listener's start before the failure: the error is the last line.
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"tickline {command}: error: Couldn't listen on 127.0.0.1:{busy}")
    assert "Address already in use" in line and "Traceback" not in result.stderr
