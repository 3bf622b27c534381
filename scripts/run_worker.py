"""``tickline worker``: build a worker from the config and flags, run it until stopped."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

import attr

from scripts.config import Config, ConfigError, parse_address, parse_metrics_address
from scripts.daemon import run_daemon
from storage.schema import NAME_WORD
from storage.urls import parse_database_url
from storage.worker_store import open_worker_store
from workers.caches import CacheRegistry
from workers.handlers import HandlerError, HandlerRegistry, load_handler
from workers.worker import UnknownStreamError, Worker, WorkerConfig

# The interpreter's switch interval in a worker (CPython's default: 5 ms). The database
# thread waits for its backend with the GIL released and needs it back at every answer
# (BEGIN, COPY, COMMIT), while the reactor thread holds it making the next group's COPY
# text and parsing rows: at 5 ms that handover stretched each 5,000-row COPY apply of a
# catch-up from about 6.7 to 9.3 ms (docs/benchmarks.md, cu3).
SWITCH_INTERVAL = 0.0005


def worker_config(args: argparse.Namespace, config: Config) -> WorkerConfig:
    """The config's worker section with the command line's overrides."""
    wc = config.worker
    changes: dict = {}
    if args.name:
        if not NAME_WORD.fullmatch(args.name):
            raise ConfigError("--name must be one word of printable ASCII")
        changes["name"] = args.name
    if args.master:
        changes["master_host"], changes["master_port"] = parse_address(args.master, "--master")
    if args.database:
        parse_database_url(args.database)
        changes["database"] = args.database
    if args.server_name:
        changes["server_name"] = args.server_name
    if args.replicate:
        for stream in args.replicate:
            if stream not in config.streams:
                raise ConfigError(
                    f"--replicate: unknown stream {stream!r} (known: {', '.join(sorted(config.streams))})"
                )
        changes["replicate"] = tuple(dict.fromkeys(wc.replicate + tuple(args.replicate)))
    return attr.evolve(wc, **changes)


def run_worker(args: argparse.Namespace, config: Config) -> int:
    from twisted.internet import defer, reactor

    sys.setswitchinterval(SWITCH_INTERVAL)
    wc = worker_config(args, config)
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
    store = open_worker_store(wc.database, synchronous_commit=wc.synchronous_commit)
    worker = Worker(
        wc, config.protocol, store, config.streams, reactor, handlers, caches, config.master.secret, tls=config.tls
    )
    try:
        worker.prepare()
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
