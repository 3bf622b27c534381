"""scripts.sched_waits: a perf scheduler trace read into CPU, wake-ups and foreign runs per commit.

The lines are in ``perf script``'s format for the three events it is recorded with.
"""

from __future__ import annotations

import pytest

from scripts.sched_waits import cpu_per_task, parse, report, runs, wakeups


def _switch(t: float, cpu: int, prev: tuple[str, int], state: str, nxt: tuple[str, int]) -> str:
    return (
        f"{prev[0]:>16} {prev[1]:>5} [{cpu:03d}] {t:.6f}:       sched:sched_switch: prev_comm={prev[0]} "
        f"prev_pid={prev[1]} prev_prio=120 prev_state={state} ==> next_comm={nxt[0]} next_pid={nxt[1]} next_prio=120"
    )


def _wake(kind: str, t: float, cpu: int, current: tuple[str, int], woken: tuple[str, int], target: int) -> str:
    return (
        f"{current[0]:>16} {current[1]:>5} [{cpu:03d}] {t:.6f}:       sched:sched_{kind}: comm={woken[0]} "
        f"pid={woken[1]} prio=120 target_cpu={target:03d}"
    )


IDLE0, IDLE1 = ("swapper/0", 0), ("swapper/1", 0)
A, B, C, TOKIO = ("python", 100), ("python", 200), ("postgres", 300), ("tokio-rt-worker", 75)
TRACE = [
    _switch(1.000, 0, IDLE0, "R", A),
    # A wakes B on its own CPU: B waits until A sleeps.
    _wake("waking", 1.010, 0, A, B, 0),
    _wake("wakeup", 1.011, 0, A, B, 0),
    _switch(1.020, 0, A, "S", B),
    # B wakes C on the other, idle CPU: the wake-up is queued there 10 ms later.
    _wake("waking", 1.030, 0, B, C, 1),
    _wake("wakeup", 1.040, 1, IDLE1, C, 1),
    _switch(1.045, 1, IDLE1, "R", C),
    # A foreign task takes the other CPU for 5 ms.
    _switch(1.050, 1, C, "S", TOKIO),
    _switch(1.055, 1, TOKIO, "S", IDLE1),
    _switch(1.060, 0, B, "S", IDLE0),
    "some other line perf prints",
]


def test_the_trace_is_read_line_by_line_and_other_lines_are_skipped() -> None:
    events = list(parse(TRACE))
    assert len(events) == 10
    assert (events[1].kind, events[1].tid, events[1].cpu, events[1].fields["pid"]) == ("waking", 100, 0, "200")


def test_cpu_per_task_is_the_time_each_was_running_within_the_window() -> None:
    spent = cpu_per_task(parse(TRACE), 1.0, 1.06)
    assert spent[100] == pytest.approx(0.020)
    assert spent[200] == pytest.approx(0.040)
    assert spent[300] == pytest.approx(0.005)
    assert spent[75] == pytest.approx(0.005)
    clipped = cpu_per_task(parse(TRACE), 1.01, 1.03)
    assert clipped[100] == pytest.approx(0.010) and clipped[200] == pytest.approx(0.010)


def test_a_wake_up_is_local_or_remote_with_its_wait_to_be_queued_and_to_run() -> None:
    found = wakeups(list(parse(TRACE)), 1.0, 1.06, {200, 300})
    assert [(w.remote, round(w.to_queue, 6), round(w.to_run, 6)) for w in found[200]] == [(False, 0.001, 0.009)]
    assert [(w.remote, round(w.to_queue, 6), round(w.to_run, 6)) for w in found[300]] == [(True, 0.010, 0.005)]
    assert wakeups(list(parse(TRACE)), 1.02, 1.06, {200}) == {}  # signalled before the window


def test_a_foreign_task_s_runs_and_the_commits_they_delayed() -> None:
    (run,) = runs(list(parse(TRACE)), ("tokio-rt-worker",))
    assert (run.start, run.end, round(run.cpu_time, 6), run.comm) == (1.050, 1.055, 0.005, "tokio-rt-worker")
    trace = {
        "which": "tickline",
        "committed": {"1": 1.0, "2": 1.049},
        "applied": {"1": 1.0004, "2": 1.057},
        "roles": {"100": "committer", "200": "master", "300": "worker"},
    }
    lines = report(trace, list(parse(TRACE)), ("tokio-rt-worker",))
    assert "  tokio-rt-worker ran 5.0 ms at 1.0500: 1 commits in flight, worst 8.0 ms" in lines
    assert lines[-1].startswith("  p99 commit -> applied 8.000 ms; without the 1 commits in flight")
    assert lines[-1].endswith(": 0.400 ms")
    assert any(line.startswith("  wake-ups of worker: remote 0.50 (to queue 10000, to run 5000") for line in lines)


def test_the_benchmark_names_backends_and_processes_by_what_they_run() -> None:
    from scripts.bench_pg import _backend_role, _process_role

    assert _backend_role("client backend", "tickline-apply", "PREPARE tickline_apply_1 (text)") == "apply"
    assert _backend_role("client backend", "tickline", "LISTEN tickline") == "listen"
    assert _backend_role("client backend", "tickline", "EXECUTE tickline_0 (1, 2)") == "writer"
    assert _backend_role("client backend", "tickline", "COMMIT") == ""
    assert _backend_role("walsender", "s_t1", "START_REPLICATION SLOT") == "walsender"
    assert _backend_role("logical replication worker", "", "") == "apply-worker"
    assert _process_role("/v/bin/python -m scripts.cli worker --name bench --master 127.0.0.1:1") == "worker"
    assert _process_role("/v/bin/python -c from scripts.bench_pg import listen_main; listen_main() u 0") == "listeners"
    assert _process_role("/usr/bin/perf record -a") == ""
