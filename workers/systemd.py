"""systemd's notify protocol: READY=1, STATUS=, STOPPING=1 and WATCHDOG=1.

Messages are datagrams to the unix socket named by ``NOTIFY_SOCKET`` (a name
starting with ``@`` is in the abstract namespace). Without that variable
every call does nothing, so the same code runs under systemd and outside it.
The watchdog is kicked from the reactor (a ``LoopingCall`` at half of
``WATCHDOG_USEC``), so a blocked reactor stops the kicks and systemd restarts
the process.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from twisted.internet import task

logger = logging.getLogger(__name__)


class SystemdNotifier:
    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self._address = self._socket_address(environ.get("NOTIFY_SOCKET"))
        self._watchdog_interval = self._watchdog_seconds(environ)
        self._socket: socket.socket | None = None
        self._watchdog: task.LoopingCall | None = None

    @staticmethod
    def _socket_address(name: str | None) -> str | bytes | None:
        if not name:
            return None
        if name.startswith("@"):
            return b"\0" + name[1:].encode()
        return name

    @staticmethod
    def _watchdog_seconds(environ: Mapping[str, str]) -> float | None:
        usec = environ.get("WATCHDOG_USEC")
        pid = environ.get("WATCHDOG_PID")
        if not usec:
            return None
        if pid and pid != str(os.getpid()):
            return None  # the watchdog is meant for another process
        try:
            return int(usec) / 1_000_000
        except ValueError:
            logger.warning("ignoring WATCHDOG_USEC=%r: not a number", usec)
            return None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> None:
        """Send ``KEY=value`` lines, e.g. ``notify("READY=1", "STATUS=listening")``."""
        if self._address is None:
            return
        message = "\n".join(a.replace("\n", " ") for a in assignments)
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._socket.sendto(message.encode("utf-8"), self._address)
        except OSError as e:
            logger.warning("cannot notify systemd at %r: %s", self._address, e)

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self, status: str = "stopping") -> None:
        self.notify("STOPPING=1", f"STATUS={status}")

    def start_watchdog(self, clock: Any) -> None:
        """Kick the watchdog from the reactor at half of WATCHDOG_USEC."""
        if self._address is None or self._watchdog_interval is None or self._watchdog is not None:
            return
        self._watchdog = task.LoopingCall(self.notify, "WATCHDOG=1")
        self._watchdog.clock = clock
        self._watchdog.start(self._watchdog_interval / 2, now=True)

    def stop_watchdog(self) -> None:
        if self._watchdog is not None and self._watchdog.running:
            self._watchdog.stop()
        self._watchdog = None
