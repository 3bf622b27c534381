"""What master and worker share as daemons: systemd notification, signals, status.

- ``READY=1`` once ``start`` has succeeded (listening, or connected and caught up),
  ``STATUS=`` lines every ``status_interval`` seconds, ``WATCHDOG=1`` from the
  reactor when the unit asks for it.
- SIGTERM/SIGINT: ``STOPPING=1``, then ``stop`` runs before the reactor shuts
  down; the process exits 0.
- SIGHUP: the log configuration is read again from the config file.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, cast

from twisted.internet import defer, task
from twisted.internet.error import CannotListenError
from twisted.logger import ILogObserver, STDLibLogObserver, globalLogBeginner

from scripts.config import ConfigError, load_config, setup_logging
from scripts.stopping import stop_reactor
from workers.systemd import SystemdNotifier

logger = logging.getLogger(__name__)


def run_daemon(
    reactor: Any,
    name: str,
    start: Callable[[], Awaitable[Any]],
    ready: Callable[[], defer.Deferred[str]],
    stop: Callable[[], Awaitable[None]],
    status: Callable[[], str],
    config_path: str | None,
    status_interval: float = 10.0,
) -> int:
    """Run the reactor until stopped; returns the exit code.

    ``start`` sets the service up (a failure is fatal); ``ready`` fires with
    the status line to send with ``READY=1``.
    """
    # Twisted's own messages (an unhandled error in a Deferred, ...) go to the
    # same one-line-per-event log as ours.
    # Its chatter ("Starting factory ...") stays out: warnings and errors only.
    globalLogBeginner.beginLoggingTo([cast(ILogObserver, STDLibLogObserver(name="twisted"))], redirectStandardIO=False)
    logging.getLogger("twisted").setLevel(logging.WARNING)
    notifier = SystemdNotifier()
    exit_code = [0]
    status_loop = task.LoopingCall(lambda: notifier.status(status()))
    status_loop.clock = reactor

    def failed(failure: Any) -> None:
        print(f"tickline {name}: error: {failure.getErrorMessage()}", file=sys.stderr)
        # An address that cannot be listened on (taken, not local, no permission)
        # is a mistake in the configuration, as a database that cannot be
        # reached is: exit code 2. Anything else that stops the start: 1.
        exit_code[0] = 2 if failure.check(CannotListenError) else 1
        stop_reactor(reactor)

    async def begin() -> None:
        notifier.status(f"{name} starting")
        await start()
        notifier.start_watchdog(reactor)
        status_loop.start(status_interval, now=False)
        line = await ready()
        notifier.ready(line)
        logger.info("%s ready: %s", name, line)

    async def end() -> None:
        notifier.stopping(f"{name} stopping")
        if status_loop.running:
            status_loop.stop()
        try:
            await stop()
        finally:
            notifier.stop_watchdog()

    reactor.callWhenRunning(lambda: defer.ensureDeferred(begin()).addErrback(failed))
    reactor.addSystemEventTrigger("before", "shutdown", lambda: defer.ensureDeferred(end()))
    install_log_reload(reactor, config_path)
    reactor.run()
    return exit_code[0]


def install_log_reload(reactor: Any, config_path: str | None) -> None:
    """SIGHUP reads the config file again and applies its logging section.

    Without a config file there is nothing to reload, but SIGHUP must still
    not kill the process (its default action).
    """

    def reload() -> None:
        if config_path is None:
            logger.info("SIGHUP: no config file (-c) to reload the log configuration from")
            return
        try:
            level = load_config(config_path).log_level
        except ConfigError as e:
            logger.error("SIGHUP: keeping the log configuration: %s", e)
            return
        setup_logging(level)
        logger.info("SIGHUP: log configuration reloaded (level %s)", level)

    signal.signal(signal.SIGHUP, lambda *_: reactor.callFromThread(reload))
