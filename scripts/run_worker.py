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
        gc.set_threshold(young_threshold(wc.max_pending_rows), *gc.get_threshold()[1:])

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


# Python's default: a young collection after 700 more container objects were made than freed.
DEFAULT_YOUNG_THRESHOLD = 700
MAX_YOUNG_THRESHOLD = 1_000_000


def young_threshold(max_pending_rows: int) -> int:
    """The cyclic collector's young-generation threshold for a worker holding up to ``max_pending_rows`` rows.

    Each received row is a list (a container the collector tracks) that lives
    until its group is applied. During a backlog the queue holds tens of
    thousands of them, so with the default threshold a young collection ran
    about every 700 rows and every row lived through one or two of them (and was
    promoted into the older generations, whose passes then examined it again):
    about 690 collections and 0.14-0.26 s of a 500,000-row catch-up
    (docs/benchmarks.md, cu5). The count is of objects made less objects freed,
    so with a threshold above what the queue can hold (rows waiting plus those
    held for timestamp order, twice ``max_pending_rows``), the rows alone never
    start a collection: they are freed when applied, before any pass examines
    them. Cycles (Twisted's failures and their tracebacks) are still collected,
    after at most that many objects more made than freed (capped at
    ``MAX_YOUNG_THRESHOLD``, so a huge ``max_pending_rows`` does not let them
    pile up without bound).
    """
    return max(DEFAULT_YOUNG_THRESHOLD, min(MAX_YOUNG_THRESHOLD, 2 * max_pending_rows))


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
