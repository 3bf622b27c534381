"""Unit tests of the pieces behind bounded resources and safe logs (replication.limits, logsafe).

Timers run on ``twisted.internet.task.Clock``; no real time passes.
"""

from __future__ import annotations

import logging

import pytest
from twisted.internet.task import Clock

from replication.commands import AuthCommand, MalformedCommand, OptionsCommand, parse_line
from replication.limits import ConnectionLimiter, InputWatch, LogBudget, SharedLogBudget, too_long
from replication.logsafe import SafeFormatter, escape, safe
from replication.settings import LimitsConfig

# -- safe logs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain text", "plain text"),
        ("a\rb", "a\\rb"),
        ("a\nb", "a\\nb"),
        ("tab\there", "tab\\there"),
        ("\x1b[31mred", "\\x1b[31mred"),
        ("line\u2028sep", "line\\u2028sep"),
        ("para\u2029sep", "para\\u2029sep"),
        ("nel\u0085x", "nel\\x85x"),
        ("\u202eevil", "\\u202eevil"),
        ("nul\x00", "nul\\x00"),
        ("del\x7f", "del\\x7f"),
        ("café ☕", "café ☕"),  # printable Unicode stays readable
        ("back\\slash", "back\\slash"),
    ],
)
def test_escape(raw: str, shown: str) -> None:
    assert escape(raw) == shown
    assert escape(escape(raw)) == escape(raw)  # idempotent


def test_safe_cuts_long_text_and_decodes_bytes() -> None:
    assert safe("x" * 250) == "x" * 200 + "...(50 more chars)"
    assert safe(b"ok\xff\r") == "ok\\xff\\r"
    assert safe(42) == "42"


def test_safe_formatter_escapes_every_message_but_keeps_tracebacks() -> None:
    formatter = SafeFormatter("%(message)s")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "peer said %s", ("a\rb\u2028c",), None)
    assert formatter.format(record) == "peer said a\\rb\\u2028c"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = formatter.format(record)
    assert text.startswith("failed\nTraceback")


# -- log budget --------------------------------------------------------------------------


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def recorder():
    log = logging.getLogger("tickline.test.limits")
    log.setLevel(logging.INFO)
    log.propagate = False
    handler = Recorder()
    log.addHandler(handler)
    yield log, handler
    log.removeHandler(handler)


def test_log_budget_limits_lines_per_second_and_summarizes(recorder) -> None:
    log, handler = recorder
    clock = Clock()
    budget = LogBudget(clock, 3, SharedLogBudget(clock, 100))
    for i in range(1000):
        budget.log(log, logging.INFO, "c1", "bad input: %s", f"line {i}\r")
    assert handler.lines == ["[c1] bad input: line 0\\r", "[c1] bad input: line 1\\r", "[c1] bad input: line 2\\r"]
    clock.advance(1.0)
    budget.log(log, logging.INFO, "c1", "bad input: %s", "next")
    assert handler.lines[3:] == ["[c1] suppressed 997 log lines (more than 3 per second)", "[c1] bad input: next"]


def test_log_budget_reports_what_was_suppressed_when_the_connection_closes(recorder) -> None:
    log, handler = recorder
    clock = Clock()
    budget = LogBudget(clock, 2, None)
    for _ in range(10):
        budget.log(log, logging.INFO, "c1", "x")
    budget.flush(log, "c1")
    assert handler.lines[-1] == "[c1] suppressed 8 log lines (more than 2 per second)"
    budget.flush(log, "c1")  # nothing more to report
    assert len(handler.lines) == 3


def test_forced_lines_pass_the_connection_limit(recorder) -> None:
    log, handler = recorder
    clock = Clock()
    budget = LogBudget(clock, 1, None)
    budget.log(log, logging.INFO, "c1", "one")
    budget.log(log, logging.INFO, "c1", "two")
    budget.log(log, logging.WARNING, "c1", "closing: %s", "why", force=True)
    assert handler.lines == ["[c1] one", "[c1] closing: why"]


def test_the_shared_budget_bounds_all_connections_together(recorder) -> None:
    log, handler = recorder
    clock = Clock()
    shared = SharedLogBudget(clock, 5)
    budgets = [LogBudget(clock, 10, shared) for _ in range(10)]
    for budget in budgets:
        for _ in range(10):
            budget.log(log, logging.INFO, "c", "x")
    assert len(handler.lines) == 5


# -- timeouts ------------------------------------------------------------------------


def test_input_watch_timeouts() -> None:
    limits = LimitsConfig(auth_timeout=10, idle_timeout=60, line_timeout=30)
    watch = InputWatch(limits, 0.0, needs_auth=True)
    assert watch.check(9.9, False, 0) is None
    assert watch.check(10.0, False, 0) == ("auth_timeout", "authentication timeout: no AUTH within 10 s")
    assert watch.check(10.0, True, 0) is None
    # A line that never ends: the clock starts with its first byte, any newline restarts it.
    watch.data(20.0, had_newline=False, pending=1)
    watch.data(45.0, had_newline=False, pending=26)
    assert watch.check(49.9, True, 26) is None
    assert watch.check(50.0, True, 26) == ("line_timeout", "line timeout: 26 bytes without a newline for 30 s")
    watch.data(50.0, had_newline=True, pending=3)
    watch.command(50.0)
    assert watch.check(79.0, True, 3) is None
    # No command at all for idle_timeout.
    watch.command(70.0)
    assert watch.check(129.9, True, 0) is None
    assert watch.check(130.0, True, 0) == ("idle_timeout", "idle timeout: no command for 60 s")
    assert watch.check(130.0, True, 0, consuming=True) is None  # it replicates: it listens


def test_connection_limiter_counts_and_releases() -> None:
    limiter = ConnectionLimiter(LimitsConfig(max_connections=3, max_connections_per_address=2), Clock())
    a1, _, _ = limiter.acquire("10.0.0.1")
    limiter.acquire("10.0.0.1")
    refused, reason, why = limiter.acquire("10.0.0.1")
    assert refused is None and reason == "per_address"
    assert why == "too many connections from 10.0.0.1: the limit is 2 per address"
    b1, _, _ = limiter.acquire("10.0.0.2")
    refused, reason, why = limiter.acquire("10.0.0.3")
    assert refused is None and reason == "total" and why == "too many connections: the limit is 3"
    assert a1 is not None and b1 is not None
    a1.release()
    a1.release()  # only once
    assert limiter.total == 2 and limiter.by_address["10.0.0.1"] == 1
    again, _, _ = limiter.acquire("10.0.0.3")
    assert again is not None


def test_too_long_counts_bytes() -> None:
    limits = LimitsConfig(max_name_bytes=4)
    assert too_long(limits, instance="abcd") is None
    assert too_long(limits, instance="abcde") == "instance is 5 bytes long, the limit is 4"


# -- OPTIONS and AUTH as docs/protocol.md has them ---------------------------------------


@pytest.mark.parametrize("line", ["OPTIONS ts\tlive", "OPTIONS ts  live", "OPTIONS ts\t", "OPTIONS \tts"])
def test_options_take_single_spaces_only(line: str) -> None:
    with pytest.raises(MalformedCommand, match="malformed OPTIONS"):
        parse_line(line)


def test_options_parse() -> None:
    assert parse_line("OPTIONS ts live") == OptionsCommand(frozenset({"ts", "live"}))
    assert parse_line("OPTIONS live") == OptionsCommand(frozenset({"live"}))


@pytest.mark.parametrize("line", ["AUTH s3cret", "AUTH  s3cret", "AUTH s3cret  ", "AUTH \ts3cret"])
def test_auth_strips_whitespace_around_the_secret(line: str) -> None:
    assert parse_line(line) == AuthCommand("s3cret")


def test_auth_keeps_inner_spaces_and_needs_a_secret() -> None:
    assert parse_line("AUTH two words") == AuthCommand("two words")
    with pytest.raises(MalformedCommand):
        parse_line("AUTH   ")


# -- configuration -------------------------------------------------------------------


def test_limit_and_tls_keys_are_checked() -> None:
    from scripts.config import ConfigError, config_from_mapping

    config = config_from_mapping({"master": {"max_connections": 5, "idle_timeout": 2.5, "poll_interval": 0.1}})
    assert config.limits.max_connections == 5 and config.limits.idle_timeout == 2.5
    assert config.master.poll_interval == 0.1
    for bad, message in [
        ({"master": {"idle_timeout": float("inf")}}, "master.idle_timeout: expected a finite number"),
        ({"master": {"line_timeout": 1e-300}}, "master.line_timeout: 1e-300 is out of range"),
        ({"master": {"max_connections": 0}}, "master.max_connections: expected a positive whole number"),
        ({"tls": {"bogus": 1}}, "tls.bogus: unknown key"),
        ({"tls": {"ca": "/nonexistent/ca.pem"}}, "tls.ca: cannot read /nonexistent/ca.pem"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_mapping(bad)


def test_the_summary_comes_without_a_further_line(recorder, caplog) -> None:
    log, handler = recorder
    clock = Clock()
    shared = SharedLogBudget(clock, 3)
    budget = LogBudget(clock, 2, shared)
    other = LogBudget(clock, 2, shared)
    for _ in range(5):
        budget.log(log, logging.INFO, "c1", "x")
        other.log(log, logging.INFO, "c2", "y")
    budget.tick(log, "c1")
    assert len(handler.lines) == 3  # the second is not over yet
    clock.advance(1.0)
    budget.tick(log, "c1")
    assert "[c1] suppressed 3 log lines (more than 2 per second)" in handler.lines
    # The shared budget's own summary (over all connections) is logged by replication.limits.
    assert any("log lines about peers (more than 3 per second over all connections)" in m for m in caplog.messages)
