"""The README's first command: ``scripts/demo.sh`` runs, shows rows, and stops cleanly.

Stopped the way a person stops it (Ctrl-C in a terminal, here through a
pseudo-terminal) and the way a supervisor does (SIGTERM): no traceback,
exit status 0, and none of its processes left running.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.procs import free_port, wait_for

DEMO = ROOT / "scripts" / "demo.sh"


@pytest.fixture(autouse=True)
def _interrupt_not_ignored() -> Iterator[None]:
    """The demo starts with SIGINT's default action, as a terminal's shell starts a command.

    When the test run itself ignores SIGINT (a background job of a
    non-interactive shell: ``pytest ... &`` in a script), the demo's bash
    would inherit that, and a signal ignored when a non-interactive bash
    starts can be neither trapped nor reset (POSIX): its Ctrl-C trap would
    never run, and the demo would not stop. Python's own handler here
    becomes the default action across ``exec``.
    """
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _demo_config(tmp: Path) -> Path:
    text = (ROOT / "sample_config.yaml").read_text()
    text = text.replace("database: sqlite:///tickline.db", f"database: sqlite:///{tmp / 'tickline.db'}")
    text = text.replace("database: sqlite:///worker.db", f"database: sqlite:///{tmp / 'worker.db'}")
    text = text.replace("listen: 127.0.0.1:9322", f"listen: 127.0.0.1:{free_port()}")
    config = tmp / "demo.yaml"
    config.write_text(text)
    return config


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children_of(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _read_until(fd: int, needle: bytes, timeout: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while needle not in out and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:
                break
    return out


def _drain(fd: int, timeout: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def test_ctrl_c_in_a_terminal_stops_everything_without_a_traceback(tmp_path: Path) -> None:
    config = _demo_config(tmp_path)
    pid, fd = pty.fork()
    if pid == 0:  # the child: the demo, as typed in a terminal
        os.chdir(ROOT)
        os.environ["TICKLINE_CONFIG"] = str(config)
        os.execvp("bash", ["bash", str(DEMO)])
    try:
        shown = _read_until(fd, b'"stream":"events"', 60)
        assert b'"stream":"events"' in shown, shown.decode(errors="replace")[-2000:]
        children = _descendants(pid)
        os.write(fd, b"\x03")  # Ctrl-C
        # Read the terminal until the demo has exited: a demo whose processes
        # block writing their last log lines to a full pty would never end.
        deadline = time.monotonic() + 60
        status = None
        while status is None:
            shown += _drain(fd, 0.5)
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
            elif time.monotonic() > deadline:
                pytest.fail("the demo did not exit within 60 s of Ctrl-C:\n" + shown.decode(errors="replace")[-2000:])
            else:
                time.sleep(0.05)  # bounded poll of the exit: the pty gave EOF or nothing
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)
    text = shown.decode(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert "ReactorNotRunning" not in text
    assert os.waitstatus_to_exitcode(status) == 0, text[-2000:]
    wait_for(lambda: not any(_alive(c) for c in children), 10, "the demo's processes to end")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_script_stops_everything_without_a_traceback(tmp_path: Path, sig: int) -> None:
    config = _demo_config(tmp_path)
    env = dict(os.environ, TICKLINE_CONFIG=str(config))
    proc = subprocess.Popen(
        ["bash", str(DEMO)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        deadline = time.monotonic() + 60
        while b'"stream":"events"' not in first and time.monotonic() < deadline and first:
            first = proc.stdout.readline()
        assert b'"stream":"events"' in first
        children = _descendants(proc.pid)
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (first + rest).decode(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert proc.returncode == 0, text[-2000:]
    wait_for(lambda: not any(_alive(c) for c in children), 10, "the demo's processes to end")
