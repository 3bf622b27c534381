"""The timeline on a real master process, over real sockets, on SQLite and PostgreSQL."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from tests.conftest import LineClient

LEASE_LINE = "LEASE "


class Consumer:
    """A line client that speaks the timeline: answers are matched, LEASE lines collected."""

    def __init__(self, client: LineClient) -> None:
        self.client = client
        self.leases: list[tuple[float, list[str], str]] = []  # (received ms, fields, body)
        client.handshake()

    def _take(self, line: str) -> None:
        if line.startswith(LEASE_LINE):
            fields = line.split(" ", 5)
            self.leases.append((time.time() * 1000, fields[1:5], fields[5]))

    def call(self, line: str, timeout: float = 5.0) -> str:
        """Send one command, return its ACK/NACK/ERROR (LEASE lines meanwhile are collected)."""
        self.client.send(line)
        return self.answer(timeout)

    def answer(self, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            got = self.client.read_line(max(0.0, deadline - time.monotonic()))
            if got.startswith(("ACK ", "NACK ", "ERROR ")):
                return got
            self._take(got)

    def wait_leases(self, count: int, timeout: float = 5.0) -> list[tuple[float, list[str], str]]:
        deadline = time.monotonic() + timeout
        while len(self.leases) < count:
            line = self.client.try_line(max(0.0, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"{len(self.leases)} of {count} leases within {timeout} s")
            self._take(line)
        return self.leases

    def no_lease_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            line = self.client.try_line(left)
            if line is None:
                return
            assert not line.startswith(LEASE_LINE), line


def consumer(m) -> Consumer:
    return Consumer(m.connect())


def now_ms() -> int:
    return int(time.time() * 1000)


def test_hundreds_due_within_a_second_each_delivered_once_never_early(master, db_url: str) -> None:
    m = master(database=db_url)
    producer = consumer(m)
    start = now_ms() + 300
    due = {}
    for i in range(300):
        due[f"m{i}"] = start + random.randrange(1000)
    for mid, at in due.items():
        producer.client.send(f'SCHEDULE jobs g {mid} {at} {{"n":"{mid}"}}')
    for _ in due:
        assert producer.answer().startswith("ACK SCHEDULE jobs ")
    consumers = [consumer(m) for _ in range(4)]
    got: dict[int, list[tuple[float, str, str, str]]] = {i: [] for i in range(4)}
    errors: list[str] = []

    def run(i: int) -> None:
        c = consumers[i]
        c.client.send(f"TIMELINE jobs c{i} 8 30000")
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline and sum(len(v) for v in got.values()) < len(due):
                line = c.client.try_line(0.2)
                if line is None:
                    continue
                if line.startswith(LEASE_LINE):
                    _, _, mid, version, _until, body = line.split(" ", 5)
                    got[i].append((time.time() * 1000, mid, version, body))
                    c.client.send(f"DELETE jobs {mid} {version}")
                elif line.startswith(("NACK", "ERROR")):
                    errors.append(line)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    delivered = [mid for v in got.values() for _, mid, _, _ in v]
    assert sorted(delivered) == sorted(due), "each message delivered exactly once"
    for v in got.values():
        for received, mid, _, body in v:
            assert received >= due[mid], f"{mid} pushed {due[mid] - received:.1f} ms early"
            assert body == f'{{"n":"{mid}"}}'
    assert sum(1 for v in got.values() if v) >= 2, "spread over consumers"


def test_abandoned_lease_goes_to_another_consumer_and_the_first_delete_is_refused(master, db_url: str) -> None:
    m = master(database=db_url)
    a, b = consumer(m), consumer(m)
    assert a.call("SCHEDULE jobs g job1 +0 {}").startswith("ACK SCHEDULE jobs job1 1 ")
    a.client.send("TIMELINE jobs A 1 400")
    (_, (topic, mid, version, until), _), *_ = a.wait_leases(1)
    assert (topic, mid, version) == ("jobs", "job1", "2")
    b.client.send("TIMELINE jobs B 1 30000")
    (received, (_, mid_b, version_b, _), _), *_ = b.wait_leases(1, timeout=5)
    assert mid_b == "job1" and int(version_b) == 3
    assert received >= int(until), "re-delivered only after the first lease expired"
    assert a.call(f"DELETE jobs job1 {version}") == "NACK DELETE jobs job1 not the holder"
    assert b.call(f"DELETE jobs job1 {version_b}").startswith("ACK DELETE jobs job1 4 ")


def test_extend_release_cancel_move_under_every_condition(master, db_url: str) -> None:
    m = master(database=db_url)
    c, other = consumer(m), consumer(m)
    # Nothing to act on yet.
    assert c.call("EXTEND jobs x 1 1000") == "NACK EXTEND jobs x not the holder"  # no TIMELINE here
    c.client.send("TIMELINE jobs C 1 1500")
    other.client.send("TIMELINE jobs O 1 1000")
    assert c.call("EXTEND jobs x 1 1000") == "NACK EXTEND jobs x unknown message"
    assert c.call("CANCEL jobs g x") == "NACK CANCEL jobs x unknown message"
    assert c.call("MOVE jobs g x +10") == "NACK MOVE jobs x unknown message"
    # Waiting: the owner moves and cancels; others may not.
    assert c.call("SCHEDULE jobs g w +60000 {}").startswith("ACK SCHEDULE jobs w 1 ")
    assert c.call("MOVE jobs h w +50000") == "NACK MOVE jobs w not the owner"
    assert c.call("CANCEL jobs h w") == "NACK CANCEL jobs w not the owner"
    assert c.call("MOVE jobs g w +70000").startswith("ACK MOVE jobs w 2 ")
    assert c.call("CANCEL jobs g w").startswith("ACK CANCEL jobs w 3 ")
    assert c.call("CANCEL jobs g w") == "NACK CANCEL jobs w unknown message"
    # Leased: only the holder with its version; the owner cannot touch it.
    other.client.send("TIMELINE jobs O 1 1000")  # same id again: only settings change
    at = now_ms() + 200
    assert c.call(f"SCHEDULE jobs g j {at} [1]").startswith(f"ACK SCHEDULE jobs j 1 {at}")
    # Either consumer may get it: read both until one has it.
    deadline = time.monotonic() + 5
    while not c.leases and not other.leases and time.monotonic() < deadline:
        for x in (c, other):
            line = x.client.try_line(0.05)
            if line is not None:
                x._take(line)
    holder, out = (c, other) if c.leases else (other, c)
    (_, (_, _mid, version, _), _) = holder.leases[0]
    assert int(version) == 2
    assert out.call(f"EXTEND jobs j {version} 1000") == "NACK EXTEND jobs j not the holder"
    assert holder.call("EXTEND jobs j 1 1000") == "NACK EXTEND jobs j stale version"
    assert c.call("CANCEL jobs g j") == "NACK CANCEL jobs j leased"
    assert c.call("MOVE jobs g j +1") == "NACK MOVE jobs j leased"
    ext = holder.call(f"EXTEND jobs j {version} 60000").split()
    assert ext[:5] == ["ACK", "EXTEND", "jobs", "j", "3"] and int(ext[5]) >= now_ms() + 55_000
    assert holder.call(f"RELEASE jobs j {version} 0") == "NACK RELEASE jobs j stale version"
    rel = holder.call("RELEASE jobs j 3 300").split()
    released_at = int(rel[5])
    assert rel[:5] == ["ACK", "RELEASE", "jobs", "j", "4"]
    assert holder.call("DELETE jobs j 4") == "NACK DELETE jobs j not the holder"
    # Released into the future: leased again once due, never before.
    deadline = time.monotonic() + 5
    while len(c.leases) + len(other.leases) < 2 and time.monotonic() < deadline:
        for x in (c, other):
            line = x.client.try_line(0.05)
            if line is not None:
                x._take(line)
    second = [x for x in c.leases + other.leases if x[1][2] == "5"]
    assert second and second[0][0] >= released_at and second[0][1][1] == "j"


def test_lease_expired_is_named(master, db_url: str) -> None:
    m = master(database=db_url)
    c = consumer(m)
    assert c.call("SCHEDULE jobs g first +0 {}").startswith("ACK")
    c.client.send("TIMELINE jobs C 1 300")
    c.wait_leases(1)
    # Due before the first lease ends: the next pass leases it (credit 1) once the first expired.
    assert c.call("SCHEDULE jobs g second +50 {}").startswith("ACK")
    c.wait_leases(2, timeout=5)
    assert c.leases[1][1][1] == "second"
    assert c.call("EXTEND jobs first 2 1000") == "NACK EXTEND jobs first lease expired"
    assert c.call("DELETE jobs first 2") == "NACK DELETE jobs first lease expired"


def test_consumer_restart_gets_its_active_leases_back(master, db_url: str) -> None:
    m = master(database=db_url)
    c = consumer(m)
    for i in range(3):
        assert c.call(f"SCHEDULE jobs g r{i} +0 {{}}").startswith("ACK")
    c.client.send("TIMELINE jobs worker-1 3 30000")
    first = sorted(tuple(x[1]) for x in c.wait_leases(3))
    c.client.close()
    again = consumer(m)
    assert again.call("SCHEDULE jobs g r9 +0 {}").startswith("ACK")
    again.client.send("TIMELINE jobs worker-1 3 30000")
    back = sorted(tuple(x[1]) for x in again.wait_leases(3))
    assert back == first
    again.no_lease_for(0.5)  # credit 3 is in use: r9 waits
    for _, mid, version, _ in back:
        assert again.call(f"DELETE jobs {mid} {version}").startswith(f"ACK DELETE jobs {mid} ")
    again.wait_leases(4)
    assert again.leases[3][1][1] == "r9"


def test_repeated_schedule_returns_the_existing_message(master, db_url: str) -> None:
    m = master(database=db_url)
    c = consumer(m)
    first = c.call('SCHEDULE jobs g same +100 {"v":1}')
    second = c.call('SCHEDULE jobs g same +5000 {"v":2}')
    assert first.startswith("ACK SCHEDULE jobs same 1 ")
    assert second == first
    generated = c.call("SCHEDULE jobs g - +0 null").split()
    assert generated[:3] == ["ACK", "SCHEDULE", "jobs"] and len(generated[3]) == 26
    c.client.send("TIMELINE jobs C 5 30000")
    leases = c.wait_leases(2)
    bodies = {x[1][1]: x[2] for x in leases}
    assert bodies["same"] == '{"v":1}'


def test_bad_lines_and_unknown_topics_get_error(master) -> None:
    m = master("timeline:\n  topics: [mail]\n")
    c = consumer(m)
    assert c.call("SCHEDULE nope g a +0 {}") == "ERROR unknown topic 'nope' (topics: jobs, mail)"
    assert c.call("TIMELINE nope c 1 1000") == "ERROR unknown topic 'nope' (topics: jobs, mail)"
    assert c.call("SCHEDULE jobs g a +0 {oops").startswith("ERROR malformed SCHEDULE: bad body JSON")
    assert c.call("DELETE jobs a").startswith("ERROR malformed DELETE: expected DELETE <topic> <id> <version>")
    assert c.call("TIMELINE jobs c 0 1000").startswith("ERROR malformed TIMELINE: credit must be between 1")
    assert c.call("SCHEDULE mail g a +0 {}").startswith("ACK SCHEDULE mail a 1 ")
    # One consumer id per topic per connection.
    c.client.send("TIMELINE jobs c 1 1000")
    assert c.call("TIMELINE jobs d 1 1000").startswith("ERROR this connection already consumes 'jobs' as 'c'")


def test_master_killed_with_leases_outstanding_loses_nothing(master, db_url: str, tmp_path: Path) -> None:
    m = master(database=db_url)
    c = consumer(m)
    ids = [f"k{i}" for i in range(40)]
    for mid in ids:
        c.client.send(f"SCHEDULE jobs g {mid} +0 {{}}")
    for _ in ids:
        assert c.answer().startswith("ACK SCHEDULE")
    c.client.send("TIMELINE jobs held 10 30000")
    held = {x[1][1]: x[1][2] for x in c.wait_leases(10)}
    m.process.kill()
    m.process.wait(10)
    m2 = master(database=db_url)
    back = consumer(m2)
    back.client.send("TIMELINE jobs held 10 30000")
    returned = {x[1][1]: x[1][2] for x in back.wait_leases(10)}
    assert returned == held
    back.leases.clear()
    other = consumer(m2)
    other.client.send("TIMELINE jobs fresh 10 30000")
    done: set[str] = set()
    for mid, version in returned.items():
        assert back.call(f"DELETE jobs {mid} {version}").startswith("ACK DELETE")
        done.add(mid)
    deadline = time.monotonic() + 15
    while len(done) < len(ids) and time.monotonic() < deadline:
        for x in (back, other):
            while x.leases:
                _, (_, mid, version, _), _ = x.leases.pop()
                assert mid not in done
                assert x.call(f"DELETE jobs {mid} {version}").startswith("ACK DELETE")
                done.add(mid)
            line = x.client.try_line(0.05)
            if line is not None:
                x._take(line)
    assert done == set(ids)


def test_netcat_half_close_gets_every_answer_and_the_first_leases(master, nc_path: str) -> None:
    import subprocess

    m = master()

    def nc(text: str) -> list[str]:
        out = subprocess.run(
            [nc_path, "-q1", m.host, str(m.port)], input=text.encode(), capture_output=True, timeout=20
        ).stdout.decode()
        return [line for line in out.splitlines() if not line.startswith(("SERVER ", "PING "))]

    lines = nc('SCHEDULE jobs g a +0 {"x": 1}\nSCHEDULE jobs g b +0 [2]\nCANCEL jobs g b\n')
    assert [line.split()[:5] for line in lines] == [
        ["ACK", "SCHEDULE", "jobs", "a", "1"],
        ["ACK", "SCHEDULE", "jobs", "b", "1"],
        ["ACK", "CANCEL", "jobs", "b", "2"],
    ]
    (lease,) = nc("TIMELINE jobs c 5 30000\n")
    assert lease.startswith("LEASE jobs a 2 ") and lease.endswith(' {"x":1}')
    assert nc("TIMELINE jobs c 5 30000\n") == [lease]  # the same consumer id gets it back
