"""``tickline worker``: build a worker from the config and flags, run it until stopped."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

from scripts.config import Config, ConfigError, parse_metrics_address
from scripts.daemon import run_daemon
from scripts.worker_start import WorkerStart, worker_config
from workers.caches import CacheRegistry
from workers.handlers import HandlerError, HandlerRegistry, load_handler
from workers.worker import UnknownStreamError, Worker, WorkerConfig


def run_worker(args: argparse.Namespace, config: Config, begun: WorkerStart | None = None) -> int:
    """Run the worker; ``begun``: its set-up thread, started by the command line before these imports."""
    from twisted.internet import defer, reactor

    if begun is None:
        begun = WorkerStart.begin(worker_config(args, config))
    wc = begun.config
    try:
        handlers = HandlerRegistry()
        try:
            for stream, path in wc.handlers:
                handlers.register(stream, load_handler(path))
        except HandlerError as e:
            raise ConfigError(f"worker.handlers: {e}") from None
        metrics = (
            parse_metrics_address(args.metrics_listen, "--metrics-listen")
            if args.metrics_listen
            else config.worker_metrics_listen
        )
        caches = CacheRegistry(config.caches.special, config.caches.max_size)
        store = begun.store()  # opened and migrated by its own thread; raises what that raised
        worker = Worker(
            wc, config.protocol, store, config.streams, reactor, handlers, caches, config.master.secret, tls=config.tls
        )
    except BaseException:
        begun.abandon()  # a start that stops before prepare: the set-up thread ends, its store closed
        raise
    try:
        begun.prepare(worker.prepare)  # with the connection that migrated the store
    except UnknownStreamError as e:
        raise ConfigError(str(e)) from None
    timeline = timeline_consumers(wc, config, reactor)

    async def start() -> None:
        if metrics is not None:
            # Imported only when asked for: twisted.web and prometheus_client take about
            # 0.1 s to import, on the path of every start (a worker's catch-up waits for it).
            from scripts.metrics import serve_metrics
            from workers.worker_metrics import WorkerCollector

            serve_metrics(reactor, WorkerCollector(worker), *metrics)
        worker.start()
        for consumer in timeline:
            consumer.start()
        # As the master: what start-up built is moved out of the cyclic
        # collector's way (full collections of 15-25 ms paused small applies).
        gc.freeze()

    async def stop() -> None:
        for consumer in timeline:
            consumer.stop()
        await worker.stop()

    def ready() -> defer.Deferred[str]:
        # READY=1 once connected and caught up with every stream.
        def caught_up(_: object) -> str:
            gc.freeze()  # and what connecting and catching up built (modules, prepared statements)
            return f"caught up; {status()}"

        return worker.when_caught_up().addCallback(caught_up)

    def status() -> str:
        streams = ", ".join(f"{s}@{c.applied}" for s, c in sorted(worker.consumers.items()))
        state = "connected" if worker.client is not None else f"connecting to {wc.master_host}:{wc.master_port}"
        return f"{state}; applied {streams}"

    return run_daemon(reactor, "worker", start, ready, stop, status, config.source)


def timeline_consumers(wc: WorkerConfig, config: Config, reactor: Any) -> list[Any]:
    """One consumer per ``worker.timeline`` entry (handlers loaded now: bad paths stop start-up)."""
    if not wc.timeline:
        return []
    from workers.timeline import TimelineConsumer

    consumers = []
    for i, settings in enumerate(wc.timeline):
        if settings.topic not in config.timeline.topics:
            raise ConfigError(
                f"worker.timeline: unknown topic {settings.topic!r} (topics: {', '.join(config.timeline.topics)})"
            )
        try:
            handler = load_handler(settings.handler)
        except HandlerError as e:
            raise ConfigError(f"worker.timeline: {e}") from None
        name = wc.name if len(wc.timeline) == 1 else f"{wc.name}-{i}"
        consumers.append(
            TimelineConsumer(
                settings,
                handler,
                name,
                wc.master_host,
                wc.master_port,
                config.protocol,
                reactor,
                config.master.secret,
                wc.reconnect_max,
            )
        )
    return consumers


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: tickline worker")
