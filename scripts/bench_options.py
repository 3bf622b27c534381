"""The options of ``tickline bench`` and of ``python scripts/benchmark.py``, defined once for both parsers.

No heavy imports: ``tickline --help`` builds this parser too.
"""

from __future__ import annotations

import argparse

DEFAULT_REPEAT = 3


def add_bench_arguments(parser: argparse.ArgumentParser, scenarios_help: str = "default: all") -> None:
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=scenarios_help)
    parser.add_argument(
        "--rows",
        type=int,
        default=None,
        help="rows per scenario (default 200,000; catch-up 500,000, snapshot 1,000,000, timeline 20,000 messages)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=DEFAULT_REPEAT,
        help=f"runs per measurement, interleaved with the baseline's (default {DEFAULT_REPEAT})",
    )
    parser.add_argument("--rate", type=int, default=1000, help="latency: single-row commits per second (default 1000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="latency: seconds of paced commits (default 10)")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="end-to-end, latency, catch-up, writer: plot ratios and percentiles; "
        "fanout: master CPU per delivered row against clients (FILE-fanout.png when both)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print every run")
    parser.add_argument(
        "--db",
        choices=("sqlite", "postgresql"),
        default="sqlite",
        help="fanout: the master's database (postgresql: a throwaway server)",
    )
    parser.add_argument(
        "--variants", metavar="LIST", help="fanout: only these variants, comma-separated (e.g. live-1,replay-1)"
    )


def fanout_variants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str] | None:
    """``--variants`` as a list, each checked (``parser.error`` names an unknown one); None: all."""
    if not args.variants:
        return None
    from scripts.bench_fanout import variants

    chosen: list[str] = args.variants.split(",")
    unknown = [v for v in chosen if v not in variants()]
    if unknown:
        parser.error(f"unknown fanout variant {unknown[0]!r} (known: {', '.join(variants())})")
    return chosen
