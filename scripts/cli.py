"""The ``tickline`` command line: master, write, tail, worker, snapshot, timeline, check-config, bench."""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

# The configuration's modules (attrs classes, YAML) are imported by main(), while the
# cyclic collector is paused (see _collector_paused).
if TYPE_CHECKING:
    from scripts.config import Config
    from storage.bulk import TokenRuns
    from storage.contracts import StreamStore


class UsageError(Exception):
    """A command-line mistake: printed as ``tickline: error: ...``, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2): ``tickline <command>: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def count_arg(text: str) -> int:
    """A whole number >= 0 (a count or a token)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_arg(text: str) -> int:
    """A whole number >= 1."""
    value = count_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", metavar="FILE", help="configuration file (YAML)")


COMMANDS = ("master", "write", "tail", "worker", "snapshot", "check-config", "timeline", "bench")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with ``command``, one of :data:`COMMANDS`, only that command's.

    Parsing that command's arguments gives the same results, help and errors
    (a subcommand's parser does not list the others); a start does not build
    the other commands' parsers, nor import the timeline's (about 7 ms).
    """

    def wanted(name: str) -> bool:
        return command is None or name == command

    parser = Parser(prog="tickline", description="Line-based TCP replication.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    if wanted("master"):
        master = commands.add_parser("master", help="run the master: serve streams to workers")
        _add_config(master)
        master.add_argument("--listen", metavar="HOST:PORT", help="address to listen on")
        master.add_argument("--database", metavar="URL", help="database URL (sqlite:///path.db)")
        master.add_argument("--server-name", metavar="NAME", help="name sent in SERVER")
        master.add_argument("--metrics-listen", metavar="HOST:PORT", help="serve Prometheus /metrics here (or PORT)")

    if wanted("write"):
        write = commands.add_parser("write", help="append rows to a stream, print their tokens")
        _add_config(write)
        write.add_argument("--database", metavar="URL", help="database URL")
        write.add_argument(
            "--instance", metavar="NAME", default="writer", help="writer instance name (default: writer)"
        )
        write.add_argument(
            "--batch", action="store_true", help="all rows (with --commit-every: of each transaction) share one token"
        )
        write.add_argument(
            "--commit-every",
            metavar="N",
            type=positive_arg,
            help="commit every N rows, each N a transaction of its own, its tokens printed once committed "
            "(default: all rows in one transaction)",
        )
        write.add_argument("stream", metavar="STREAM")
        write.add_argument(
            "rows",
            metavar="ROW_JSON",
            nargs="+",
            help="a JSON array (columns in order) or object (by column name); '-' reads one row per line from stdin",
        )

    if wanted("tail"):
        tail = commands.add_parser("tail", help="follow streams like a worker, print rows as JSON")
        _add_config(tail)
        tail.add_argument("--master", metavar="HOST:PORT", help="master address (default: the config's listen)")
        tail.add_argument(
            "--from", dest="from_token", metavar="TOKEN", type=count_arg, help="replay rows after TOKEN first"
        )
        tail.add_argument("--count", metavar="N", type=count_arg, help="exit after N rows")
        tail.add_argument(
            "--since",
            metavar="WHEN",
            help="replay rows from this time first: Unix ms, ISO-8601 (UTC unless a zone is given), or -30s/-5m/-2h/-1d",
        )
        tail.add_argument(
            "--ts",
            action="store_true",
            help='add each row\'s timestamp as "ts" and its time as "ts_iso" (ISO-8601, UTC)',
        )
        tail.add_argument("--name", default="tail", help="client name sent in NAME (default: tail)")
        tail.add_argument("streams", metavar="STREAM", nargs="+")

    if wanted("worker"):
        worker = commands.add_parser("worker", help="run a worker: apply streams into its own database")
        _add_config(worker)
        worker.add_argument("--name", metavar="NAME", help="worker instance name (default: the config's worker.name)")
        worker.add_argument("--master", metavar="HOST:PORT", help="master address")
        worker.add_argument("--database", metavar="URL", help="the worker's own database URL")
        worker.add_argument("--server-name", metavar="NAME", help="expected SERVER name of the master")
        worker.add_argument(
            "--replicate",
            metavar="STREAM",
            action="append",
            default=[],
            help="copy STREAM into table replicated_STREAM (repeatable)",
        )
        worker.add_argument("--metrics-listen", metavar="HOST:PORT", help="serve Prometheus /metrics here (or PORT)")

    if wanted("snapshot"):
        snapshot = commands.add_parser("snapshot", help="read a worker's replicated stream with Spark as of one token")
        _add_config(snapshot)
        snapshot.add_argument(
            "--database", metavar="URL", help="the worker's database (default: the config's worker.database)"
        )
        snapshot.add_argument("--stream", metavar="NAME", required=True, help="the stream (table replicated_NAME)")
        snapshot.add_argument(
            "--partitions",
            metavar="N",
            type=int,
            help="token ranges read in parallel (default: spark.num_partitions)",
        )
        snapshot_range = snapshot.add_mutually_exclusive_group()
        snapshot_range.add_argument(
            "--as-of", metavar="TOKEN", type=int, help="rows with token <= TOKEN (default: the applied token)"
        )
        snapshot_range.add_argument(
            "--after", metavar="TOKEN", type=int, help="incremental: rows with TOKEN < token <= the applied token"
        )
        snapshot.add_argument(
            "--out", metavar="DIR", help="write Parquet and a manifest into DIR/<stream>_<after>_<token>/"
        )

    if wanted("check-config"):
        check = commands.add_parser("check-config", help="validate a configuration file")
        check.add_argument("-c", "--config", metavar="FILE", required=True)

    if wanted("timeline"):
        from scripts.timeline_cli import add_parser as add_timeline_parser

        add_timeline_parser(commands)

    if wanted("bench"):
        from scripts.bench_options import add_bench_arguments

        add_bench_arguments(commands.add_parser("bench", help="run benchmarks, print ratios against baselines"))
    return parser


def _relative_since(argv: Sequence[str]) -> list[str]:
    """``--since -5m`` as ``--since=-5m``: argparse would take ``-5m`` for an option."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--since":
            value = next(args, None)
            if value is None:
                out.append(arg)
            elif value.startswith("-") and value[1:2].isdigit():
                out.append(f"--since={value}")
            else:
                out += [arg, value]
        else:
            out.append(arg)
    return out


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic collector off while a start imports its modules and reads its config.

    Imports allocate hundreds of thousands of objects that live as long as the
    process, and the collector's passes over them (full ones as the heap grows)
    cost about a tenth of a start's import time; they are examined once, after.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    with _collector_paused():
        from scripts.config import ConfigError
        from storage.schema import RowError, SchemaError
        from storage.store import StorageError
        from storage.urls import BadDatabaseUrl

        argv = _relative_since(sys.argv[1:] if argv is None else argv)
        # A command named first: only its parser (anything else, e.g. --help: all of them).
        parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
        args = parser.parse_args(argv)
    try:
        with _collector_paused():
            command = _command(parser, args)
        return command()
    except (ConfigError, UsageError, BadDatabaseUrl, SchemaError, RowError, StorageError) as e:
        print(f"tickline {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _is_database_error(e):
            raise
        print(f"tickline {args.command}: error: database error: {one_line(e)}", file=sys.stderr)
        return 2


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable[[], int]:
    """The command to run, its modules imported and its configuration read."""
    from scripts.config import load_config, setup_logging

    if args.command == "check-config":
        load_config(args.config)

        def checked() -> int:
            print(f"{args.config}: OK")
            return 0

        return checked
    if args.command == "bench":
        from scripts import benchmark
        from scripts.bench_options import fanout_variants

        variants = fanout_variants(parser, args)
        return lambda: benchmark.main(
            args.scenarios,
            args.rows,
            args.repeat,
            verbose=args.verbose,
            rate=args.rate,
            seconds=args.seconds,
            plot_path=args.plot,
            db=args.db,
            fanout_variants=variants,
        )
    config = load_config(args.config)
    setup_logging(config.log_level)
    run: Callable[[argparse.Namespace, Config], int]
    if args.command == "master":
        from scripts.run_master import run_master as run
    elif args.command == "write":
        run = run_write
    elif args.command == "worker":
        return _worker_command(args, config)
    elif args.command == "snapshot":
        from scripts.snapshot import run_snapshot as run
    elif args.command == "timeline":
        from scripts.timeline_cli import run_timeline as run
    elif args.command == "tail":
        from scripts.tail import run_tail as run
    else:
        raise AssertionError(args.command)
    return lambda: run(args, config)


def _worker_command(args: argparse.Namespace, config: Config) -> Callable[[], int]:
    """``tickline worker``: its database opened on its own thread while Twisted is imported here."""
    from scripts.lazy_modules import lazy_modules
    from scripts.worker_start import WorkerStart, worker_config

    begun = WorkerStart.begin(worker_config(args, config))  # see scripts.worker_start
    with lazy_modules():  # modules Twisted imports and no worker uses (scripts.lazy_modules)
        if not config.tls.client_enabled:
            from replication.tls import import_reactor_without_tls

            import_reactor_without_tls()  # about 0.1 s of a start (see replication.tls)
        from scripts.run_worker import run_worker
    # What the imports built lives as long as the worker, which moves it out of the cyclic
    # collector's way once started anyway (run_worker: gc.freeze()). Moved now, the first
    # collection after the pause (_collector_paused) does not examine these ~60,000 objects
    # on the way to the first rows (6-11 ms); it would have freed about 0.5 MB of cycles.
    gc.freeze()
    return lambda: run_worker(args, config, begun)


def one_line(error: Exception, limit: int = 500) -> str:
    """An error's message as one bounded line (database drivers add DETAIL and HINT lines)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_database_error(error: Exception) -> bool:
    from storage.bulk import is_database_error

    return is_database_error(error)


def database_url(args: argparse.Namespace, config: Config) -> str:
    from storage.urls import parse_database_url

    url = args.database or config.database
    parse_database_url(url)
    return url


def _json_rows(texts: Sequence[str], order: Callable[[Any], Any] = lambda row: row) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each ROW_JSON argument and each line of stdin for ``-``, read lazily.

    A line that is not JSON (or not UTF-8) raises UsageError naming its line
    and column; blank lines are skipped. ``order`` is applied to each parsed
    row (the stream's ``in_column_order``: objects become values in column order).
    """
    import orjson

    for i, text in enumerate(texts, 1):
        if text != "-":
            yield f"row {i}", order(_parse_json(orjson, f"row {i}", text.encode("utf-8", "surrogateescape")))
            continue
        stream = getattr(sys.stdin, "buffer", sys.stdin)
        loads, bad_json = orjson.loads, orjson.JSONDecodeError
        for n, line in enumerate(stream, 1):
            raw = line if isinstance(line, bytes) else line.encode("utf-8", "surrogateescape")
            try:
                # orjson checks UTF-8 and takes the line end as whitespace: a good line is one call.
                row = loads(raw)
            except bad_json:
                raw = raw.rstrip(b"\r\n")
                if not raw.strip():
                    continue
                row = _parse_json(orjson, f"stdin line {n}", raw)  # raises, naming what is wrong
            yield f"stdin line {n}", order(row)


def _parse_json(orjson: Any, where: str, raw: bytes) -> Any:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{where} is not valid UTF-8 at byte {e.start + 1}") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        shown = raw.strip()[:80].decode("utf-8", "replace")
        raise UsageError(f"{where} is not valid JSON at column {e.colno} ({e.msg}): {shown!r}") from None


def run_write(args: argparse.Namespace, config: Config) -> int:
    from storage.bulk import write_rows
    from storage.schema import check_instance_name
    from storage.store import open_store

    check_instance_name(args.instance)
    if args.rows.count("-") > 1:
        raise UsageError("'-' (rows from stdin) may be given once")
    store = open_store(database_url(args, config), max_line_bytes=config.protocol.max_line_bytes)
    try:
        for schema in config.streams.values():
            store.register_stream(schema)
        streams = store.catalog()
        if args.stream not in streams:
            raise UsageError(f"unknown stream {args.stream!r} (streams: {', '.join(sorted(streams))})")
        rows = _json_rows(args.rows, streams[args.stream].in_column_order())
        if args.commit_every is None:
            # One transaction for every row, streamed in chunks: all rows or none.
            tokens = write_rows(store, args.stream, rows, args.instance, batch=args.batch)
            written = len(tokens)
            if written:
                _print_tokens(tokens)  # only now: every row has committed
        else:
            written = _write_every(store, args.stream, rows, args.instance, args.batch, args.commit_every)
    finally:
        store.close()  # a PostgreSQL writer stops holding the stream back
    if not written:
        raise UsageError("no rows to write (stdin was empty)")
    return 0


def _write_every(
    store: StreamStore, stream: str, rows: Iterator[tuple[str, Any]], instance: str, batch: bool, every: int
) -> int:
    """``--commit-every``: the rows in transactions of ``every`` rows, each one's tokens printed once
    it committed (a line of stdin is written as soon as its transaction is full, or stdin ends, so
    rows fed one at a time with ``--commit-every 1`` are committed as they come). A failure names
    how many rows committed before it; the transaction it stopped is all or nothing, as a write."""
    from storage.bulk import CHUNK_ROWS, write_rows
    from storage.schema import RowError
    from storage.store import StorageError

    written = 0
    while True:
        try:
            # A transaction that fits a chunk is taken whole (its rows then go in the fewest round
            # trips); a larger one streams in chunks as the default write does.
            group: Iterable[tuple[str, Any]] = (
                list(itertools.islice(rows, every)) if every <= CHUNK_ROWS else itertools.islice(rows, every)
            )
            tokens = write_rows(store, stream, group, instance, batch=batch)
        except (RowError, StorageError, UsageError) as e:
            if not written:
                raise
            raise UsageError(f"{written:,} rows committed before this, their tokens printed; then: {e}") from None
        if not tokens:
            return written
        _print_tokens(tokens)
        written += len(tokens)


def _print_tokens(tokens: TokenRuns) -> None:
    try:
        tokens.write_lines(sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        # The rows are committed; a reader that stopped early (| head) wanted no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
