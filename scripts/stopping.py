"""Stopping the reactor from any path, once."""

from __future__ import annotations

from typing import Any

from twisted.internet.error import ReactorNotRunning


def stop_reactor(reactor: Any) -> None:
    """Stop the reactor unless it is already stopping.

    During shutdown ``reactor.running`` is still true while ``stop()`` has
    been called (a signal, or another path that ended the program), and a
    second ``stop()`` raises ``ReactorNotRunning``: a connection lost during
    shutdown is a normal end, not an error to show.
    """
    try:
        reactor.stop()
    except ReactorNotRunning:
        pass
