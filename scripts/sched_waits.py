"""Where a latency run's commits wait for a CPU: a ``perf`` scheduler trace summed per commit.

    perf record -a -k CLOCK_MONOTONIC -e sched:sched_switch,sched:sched_waking,sched:sched_wakeup \\
        -o sched.data -- .venv/bin/python -m scripts.sched_waits record DIR tickline,baseline
    perf script -i sched.data > sched.txt
    .venv/bin/python -m scripts.sched_waits report DIR/1-tickline.json sched.txt

``record`` runs the benchmark's paced single-row commits (``bench_pg.latency_once``,
1,000/s for 5 s) once per side named, on one pair of clusters, and writes each
run's commit and applied times and the path's thread ids (``roles``).
``report`` sums, over the paced commits' window, per commit:

- the CPU of each role (the time it was the running task);
- its wake-ups, *local* (queued on the waker's CPU: it runs once the waker
  sleeps or is preempted) or *remote* (queued on another CPU: the signal has to
  reach that CPU first, on this machine an interrupt to a halted virtual CPU),
  with the p50 of signal -> queued and of queued -> running;
- each run of a foreign task named by ``--task`` (default: the threads of the
  machine's init process, ``tokio-rt-worker``, and the kernel's ``kdamond``)
  of 2 ms or more, with the commits in flight meanwhile and their worst
  delay; and p99 commit -> applied with and without the commits in flight
  while such a task ran for 0.3 ms or more.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator

import attrs

_EVENT = re.compile(r"^\s*.+?\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_(\w+):\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\S*)")
FOREIGN = ("tokio-rt-worker", "kdamond")


@attrs.frozen
class Event:
    time: float
    cpu: int
    tid: int  # the running task's
    kind: str  # switch, waking, wakeup, ...
    fields: dict[str, str]


@attrs.frozen
class Wake:
    remote: bool
    to_queue: float  # seconds from the signal (sched_waking) to queued on a CPU (sched_wakeup)
    to_run: float  # from queued to running


@attrs.frozen
class Run:
    start: float
    end: float
    cpu_time: float
    comm: str


def parse(lines: Iterable[str]) -> Iterator[Event]:
    """The scheduler events of ``perf script`` text, in order."""
    for line in lines:
        m = _EVENT.match(line)
        if m:
            fields = dict(_FIELD.findall(m.group(5)))
            yield Event(float(m.group(3)), int(m.group(2)), int(m.group(1)), m.group(4), fields)


def cpu_per_task(events: Iterable[Event], lo: float, hi: float) -> defaultdict[int, float]:
    """Thread id -> seconds it was the running task within [lo, hi] (0 is the idle task)."""
    running: dict[int, tuple[float, int]] = {}
    spent: defaultdict[int, float] = defaultdict(float)
    for e in events:
        if e.kind != "switch":
            continue
        if e.cpu in running:
            since, tid = running[e.cpu]
            spent[tid] += max(0.0, min(e.time, hi) - max(since, lo))
        running[e.cpu] = (e.time, int(e.fields["next_pid"]))
    return spent


def wakeups(events: Iterable[Event], lo: float, hi: float, tids: set[int]) -> dict[int, list[Wake]]:
    """Each wake-up of ``tids`` signalled within [lo, hi]: local or remote, and its two waits."""
    signalled: dict[int, tuple[float, int]] = {}
    queued: dict[int, tuple[float, float, bool]] = {}
    found: dict[int, list[Wake]] = defaultdict(list)
    for e in events:
        if e.kind in ("waking", "wakeup"):
            tid = int(e.fields["pid"])
            if tid not in tids:
                continue
            if e.kind == "waking":
                if lo <= e.time <= hi:
                    signalled[tid] = (e.time, e.cpu)
            elif tid in signalled:
                at, cpu = signalled.pop(tid)
                queued[tid] = (at, e.time, int(e.fields["target_cpu"]) != cpu)
        elif e.kind == "switch":
            tid = int(e.fields["next_pid"])
            if tid in queued:
                at, queued_at, remote = queued.pop(tid)
                found[tid].append(Wake(remote, queued_at - at, e.time - queued_at))
    return found


def runs(events: Iterable[Event], names: tuple[str, ...], gap: float = 0.002) -> list[Run]:
    """Runs of the tasks whose name starts with one of ``names``, those apart by less than ``gap`` merged."""
    running: dict[int, tuple[float, str]] = {}
    found: list[Run] = []
    for e in sorted((e for e in events if e.kind == "switch"), key=lambda e: e.time):
        if e.cpu in running:
            since, comm = running[e.cpu]
            if comm.startswith(names):
                last = found[-1] if found else None
                if last and since - last.end < gap:
                    found[-1] = Run(last.start, e.time, last.cpu_time + e.time - since, last.comm)
                else:
                    found.append(Run(since, e.time, e.time - since, comm))
        running[e.cpu] = (e.time, e.fields["next_comm"])
    return found


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def report(trace: dict, events: list[Event], foreign: tuple[str, ...]) -> list[str]:
    """The lines ``report`` prints for one recorded run and the trace that covered it."""
    committed = {int(k): v for k, v in trace["committed"].items()}
    applied = {int(k): v for k, v in trace["applied"].items()}
    roles = {int(k): v for k, v in trace["roles"].items()}
    lo, hi, n = min(committed.values()), max(committed.values()), len(committed)
    per = 1e6 / n
    spent = cpu_per_task(events, lo, hi)
    lines = [f"{trace['which']}: {n} commits, {lo:.4f}-{hi:.4f}; per commit (us):"]
    busy = ", ".join(f"{roles[t]} {spent[t] * per:.0f}" for t in sorted(roles, key=lambda t: -spent[t]) if spent[t])
    lines.append(f"  CPU: {busy}; every task on the machine {sum(v for t, v in spent.items() if t) * per:.0f}")
    woken = wakeups(events, lo, hi, set(roles))
    for tid in sorted(woken, key=lambda t: roles[t]):
        parts = []
        for remote in (False, True):
            ws = [w for w in woken[tid] if w.remote is remote]
            if ws:
                parts.append(
                    f"{'remote' if remote else 'local'} {len(ws) / n:.2f} "
                    f"(to queue {statistics.median(w.to_queue for w in ws) * 1e6:.0f}, "
                    f"to run {statistics.median(w.to_run for w in ws) * 1e6:.0f}, "
                    f"total {sum(w.to_queue + w.to_run for w in ws) * per:.0f})"
                )
        lines.append(f"  wake-ups of {roles[tid]}: " + "; ".join(parts))
    delays = {t: (applied[t] - c) * 1000 for t, c in committed.items() if t in applied}

    def in_flight(token: int, run: Run) -> bool:  # committed before the run ended, applied after it began
        return committed[token] < run.end and committed[token] + delays[token] / 1000 > run.start

    stalls = [r for r in runs(events, foreign) if r.end > lo and r.start < hi + 0.1]
    for r in (r for r in stalls if r.cpu_time >= 0.002):
        hit = [d for t, d in delays.items() if in_flight(t, r)]
        worst = f", worst {max(hit):.1f} ms" if hit else ""
        lines.append(f"  {r.comm} ran {r.cpu_time * 1000:.1f} ms at {r.start:.4f}: {len(hit)} commits in flight{worst}")
    longer = [r for r in stalls if r.cpu_time >= 0.0003]
    clear = [d for t, d in delays.items() if not any(in_flight(t, r) for r in longer)]
    lines.append(
        f"  p99 commit -> applied {p99(list(delays.values())):.3f} ms; without the {len(delays) - len(clear)} "
        f"commits in flight while {'/'.join(foreign)} ran 0.3 ms or more: {p99(clear):.3f} ms"
    )
    return lines


def record(directory: str, sides: list[str], rate: int, seconds: float) -> None:
    import os
    import tempfile

    from scripts import bench_pg

    os.makedirs(directory, exist_ok=True)
    with bench_pg.Clusters() as clusters, tempfile.TemporaryDirectory() as workdir:
        for i, which in enumerate(sides, 1):
            trace: dict = {"which": which}
            trace["result"] = bench_pg.latency_once(clusters, workdir, rate, seconds, which, trace)
            path = os.path.join(directory, f"{i}-{which}.json")
            with open(path, "w") as f:
                json.dump(trace, f)
            print(f"{path}: {trace['result']}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sched_waits", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="paced commits, their times and the path's thread ids")
    rec.add_argument("directory")
    rec.add_argument("sides", nargs="?", default="tickline,baseline")
    rec.add_argument("--rate", type=int, default=1000)
    rec.add_argument("--seconds", type=float, default=5.0)
    rep = sub.add_parser("report", help="a recorded run against perf script text of the same time")
    rep.add_argument("trace")
    rep.add_argument("perf_script")
    rep.add_argument("--task", action="append", help="a foreign task's name prefix (repeatable)")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.directory, args.sides.split(","), args.rate, args.seconds)
        return
    with open(args.trace) as f:
        trace = json.load(f)
    with open(args.perf_script) as f:
        events = list(parse(f))
    print("\n".join(report(trace, events, tuple(args.task or FOREIGN))))


if __name__ == "__main__":
    main()
