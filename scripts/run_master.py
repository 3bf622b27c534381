"""``tickline master``: serve the streams until stopped, as a systemd-friendly daemon."""

from __future__ import annotations

import argparse
import gc

import attr

from scripts.cli import UsageError, database_url
from scripts.config import Config, parse_address, parse_metrics_address
from scripts.daemon import run_daemon
from storage.schema import NAME_WORD


def run_master(args: argparse.Namespace, config: Config) -> int:
    from twisted.internet import defer, reactor

    from replication.master import Master
    from replication.master_metrics import MasterCollector, follow_heads
    from scripts.metrics import serve_metrics
    from storage.store import open_store

    master_config = config.master
    if args.listen:
        host, port = parse_address(args.listen, "--listen")
        master_config = attr.evolve(master_config, listen_host=host, listen_port=port)
    if args.server_name:
        if not NAME_WORD.fullmatch(args.server_name):
            raise UsageError("--server-name must be one word of printable ASCII")
        master_config = attr.evolve(master_config, server_name=args.server_name)
    metrics = (
        parse_metrics_address(args.metrics_listen, "--metrics-listen") if args.metrics_listen else config.metrics_listen
    )
    from storage.timeline_store import open_timeline_store

    url = database_url(args, config)
    store = open_store(
        url,
        writer_timeout=master_config.writer_timeout,
        max_line_bytes=config.protocol.max_line_bytes,
    )
    timeline_store = open_timeline_store(url, buckets=config.timeline.buckets)
    # The database threads (DatabaseThreads of master.db_threads) are built by default.
    master = Master(
        master_config,
        config.protocol,
        store,
        config.streams,
        reactor,
        limits=config.limits,
        tls=config.tls,
        timeline_store=timeline_store,
        timeline_settings=config.timeline,
    )

    async def start() -> None:
        await master.start()
        # Everything built at startup (modules, config, stores) is moved out of the
        # cyclic collector's way: a full collection then scans only what came after
        # (full collections of 20-35 ms delayed timeline pushes; docs/benchmarks.md).
        gc.freeze()
        if metrics is not None:
            from replication.timeline_metrics import Collectors, TimelineCollector

            collector = Collectors(MasterCollector(master), TimelineCollector(master.timeline))
            serve_metrics(reactor, collector, *metrics)
            follow_heads(reactor, master)

    def ready() -> defer.Deferred[str]:
        address = master.port.getHost()
        return defer.succeed(f"listening on {address.host}:{address.port}; {status()}")

    def status() -> str:
        streams = ", ".join(f"{s}@{master.live_token(s)}" for s in master.stream_names())
        return f"{len(master.connections)} connections; streams {streams}"

    return run_daemon(reactor, "master", start, ready, master.stop, status, config.source)
