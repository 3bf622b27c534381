"""The master's one-round-trip wake-up (storage.pg_wake) answers what the threaded statements answer."""

from __future__ import annotations

import itertools
import select
import threading

import psycopg2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replication.streams import CACHES, EVENTS
from storage import pg_lines, pg_wake
from storage.pg_lines import line_sql
from storage.pg_store import PgStreamStore
from storage.pg_wake import PgWake, wake_function_sql
from storage.schema import Column, StreamSchema
from storage.store import DatabaseUnavailable, open_store
from tests.stores import pg_store
from tests.unit.test_pg_columns_out import APPENDS

NUMBERS = StreamSchema("numbers", (Column("x", "double", nullable=True), Column("flag", "boolean")))


def drive(wake: PgWake, timeout: float = 10.0):
    """Poll the non-blocking call to its end (what the reactor does in the master)."""
    while True:
        state = wake.poll()
        if state == "done":
            return wake.result()
        if state == "read":
            assert select.select([wake.fileno()], [], [], timeout)[0], "no answer"
        else:
            assert select.select([], [wake.fileno()], [], timeout)[1], "cannot send"


def threaded(store: PgStreamStore, reads: dict, read_mark: bool = True, limit: int = 1000):
    """The same answer from the threaded path (Master._wake's statements)."""
    times, positions = store.safe_point(False, allocate=False) if read_mark else (None, store.safe_positions(False))
    first = {}
    for stream, (after, variants) in reads.items():
        if positions[stream] > after:
            encoded = {}
            for v in variants:
                built = store.read_lines_json(stream, after, positions[stream], limit, f"RDATA {stream} ", v)
                assert built is not None  # no line over the limit here: PostgreSQL built them all
                data, last, count = built
                encoded[v] = data
            first[stream] = (after, (encoded, last if count else after, count))
    return times, positions, first


@pytest.fixture
def stores(pg_url):
    writer = open_store(pg_url)
    reader = pg_store(open_store(pg_url))
    for schema in (EVENTS, CACHES, NUMBERS):
        writer.register_stream(schema)
    reader.catalog()
    wake = reader.open_wake()
    yield writer, reader, wake
    wake.close()
    writer.close()
    reader.close()


def test_same_answer_as_the_threaded_statements(stores) -> None:
    writer, reader, wake = stores
    for i in range(5):
        writer.append("events", [[f"$e{i}", "!r", "m.room.message", None, None]], "w")
    writer.append("events", [["$b1", "!r", "t", "sk", None], ["$b2", "!r", "t", None, "$x"]], "w", batch=True)
    writer.append("caches", [["c", [1, "k", None, {"a": 2.5}], 7]], "w")
    writer.append(
        "numbers", [[2.0, True], [None, False], [1e300, True], [-0.5, False], [-0.0, True], [0.1 + 0.2, False]], "w"
    )
    reads = {"events": (2, (False, True)), "caches": (0, (True,)), "numbers": (0, (False,))}
    wake.start(True, reads, 1000)
    got = drive(wake)
    assert got == threaded(reader, reads)
    assert got[2]["events"][1][1:] == (6, 5)  # tokens 3..6: the batch is one token of two rows
    assert b"RDATA events w batch " in got[2]["events"][1][0][False]
    # Without the mark: no safe times; the same positions and lines.
    wake.start(False, reads, 1000)
    times, positions, first = drive(wake)
    assert times is None and positions == got[1] and first == got[2]


def test_a_range_over_the_limit_is_left_to_the_master(stores) -> None:
    """The wake-up reads a range's lines only when it holds at most ``limit`` rows, and then all of them."""
    writer, _reader, wake = stores
    writer.append("events", [["$a", "!r", "t", None, None]], "w")
    writer.append("events", [[f"$b{i}", "!r", "t", None, None] for i in range(3)], "w", batch=True)
    writer.append("events", [["$c", "!r", "t", None, None]], "w")
    for limit in (1, 2, 4):
        wake.start(True, {"events": (0, (False,))}, limit)
        _times, positions, first = drive(wake)
        assert positions["events"] == 3 and "events" not in first  # five rows: the master reads them
    wake.start(True, {"events": (0, (False,))}, 5)
    encoded, last, count = drive(wake)[2]["events"][1]
    assert (last, count) == (3, 5)  # every row up to the position, the batch whole
    assert encoded[False].count(b"\n") == 5 and encoded[False].count(b" batch ") == 2
    wake.start(True, {"events": (1, (False,))}, 4)
    assert drive(wake)[2]["events"][1][1:] == (3, 4)


def test_a_range_without_rows_moves_on(stores) -> None:
    """Tokens burnt by a rolled-back transaction: the answer says no row, up to the position."""
    writer, reader, wake = stores
    writer.append("events", [["$a", "!r", "t", None, None]], "w")
    conn = psycopg2.connect(reader.database.dsn)
    with conn.cursor() as cur:
        cur.execute("SELECT nextval('stream_events_token_seq'), nextval('stream_events_token_seq')")
    conn.close()
    writer.append("events", [["$b", "!r", "t", None, None]], "w")
    wake.start(True, {"events": (1, (False,))}, 1000)
    _times, positions, first = drive(wake)
    assert positions["events"] == 4 and first["events"][1][1:] == (4, 1)
    wake.start(True, {"events": (4, (False,))}, 1000)
    assert drive(wake)[2] == {}  # nothing above the position read


def test_lines_over_the_limit_are_left_to_the_caller(stores) -> None:
    writer, reader, wake = stores
    writer.append("events", [["$a", "!r", "t", None, None]], "w")
    writer.append("events", [["$" + "x" * 300, "!r", "t", None, None]], "w")
    reader.max_line_bytes = 200
    wake.start(True, {"events": (0, (False, True))}, 1000)
    _times, positions, first = drive(wake)
    assert positions["events"] == 2 and "events" not in first  # the master reads them on its threads


def test_a_stream_registered_later_is_covered(stores) -> None:
    writer, reader, wake = stores
    wake.start(True, {}, 1000)
    assert set(drive(wake)[1]) == {"events", "caches", "numbers"}
    later = StreamSchema("later", (Column("v", "text"),))
    writer.register_stream(later)
    writer.append("later", [["hello"]], "w")
    reader.catalog()  # the master learns new streams from the catalog
    wake.start(True, {"later": (0, (False,))}, 1000)
    _times, positions, first = drive(wake)
    assert positions["later"] == 1
    assert first["later"][1][0][False] == b'RDATA later w 1 ["hello"]\n'


def test_a_terminated_connection_raises_database_unavailable(stores) -> None:
    _writer, reader, wake = stores
    conn = psycopg2.connect(reader.database.dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'tickline-wake'")
        assert cur.fetchall() == [(True,)]
    conn.close()
    with pytest.raises(DatabaseUnavailable):
        wake.start(True, {"events": (0, (False,))}, 1000)
        drive(wake)


def test_the_wake_ups_lines_are_the_python_encoders_bytes(stores) -> None:
    """Awkward values, mixed types, a batch, both variants: the bytes of the Python encoder, built by the
    SQL of ``storage.pg_lines`` (one place says how PostgreSQL builds a line)."""
    from tests.unit.test_pg_lines import MIXED, MIXED_ROWS, TEXT_ROWS, TEXTS, _python

    writer, reader, wake = stores
    for schema, rows in ((TEXTS, TEXT_ROWS), (MIXED, MIXED_ROWS)):
        writer.register_stream(schema)
        writer.append(schema.name, rows, "w1")
        writer.append(schema.name, rows[:3], "w1", batch=True)  # one writer: its position is the head
    reader.catalog()
    reads = {TEXTS.name: (0, (False, True)), MIXED.name: (1, (False, True))}
    wake.start(True, reads, 1000)
    first = drive(wake)[2]
    # The text stream's values need escapes: read plain, they are left to the master, and its next
    # wake-ups build them escaped (pg_lines' SQL).
    assert TEXTS.name not in first and MIXED.name in first
    wake.start(True, reads, 1000)
    first = drive(wake)[2]
    for schema, rows in ((TEXTS, TEXT_ROWS), (MIXED, MIXED_ROWS)):
        after = reads[schema.name][0]
        encoded, last, count = first[schema.name][1]
        assert (last, count) == (len(rows) + 1, len(rows) + 3 - after)
        for variant in (False, True):
            assert encoded[variant] == _python(reader, schema, after, last, variant)
        assert encoded[False].count(b" batch ") == 2
    schemas = reader._catalog.known()
    sql = wake_function_sql("f", schemas, [(schemas.index(TEXTS) + 1, (False, True), False)])
    assert line_sql(TEXTS, True, "'RDATA texts '") in sql and "lead(" not in sql
    sql = wake_function_sql("f", schemas, [(schemas.index(TEXTS) + 1, (False, True), True)])
    assert pg_wake.plain_line_sql(TEXTS, True) in sql and "array_to_json" not in sql


def test_a_plain_line_of_the_widest_plain_stream_is_the_python_encoders_bytes(stores) -> None:
    """``MAX_PLAIN_COLUMNS`` text columns, two of three nullable (the first and the last, and
    nullable ones side by side): more arguments than one ``concat`` call takes (the calls are
    nested), NULLs and values side by side, a batch."""
    from tests.unit.test_pg_lines import _python

    writer, reader, wake = stores
    columns = tuple(Column(f"c{i}", "text", nullable=i % 3 != 1) for i in range(pg_wake.MAX_PLAIN_COLUMNS))
    schema = StreamSchema("wide", columns)
    assert pg_wake.plain_text(schema) and pg_wake.plain_line_sql(schema, True).count("concat(") > 1
    rows = [[f"v{i}-{k}" if k % 3 == 1 or (i + k) % 2 else None for k in range(len(columns))] for i in range(4)]
    writer.register_stream(schema)
    writer.append(schema.name, rows, "w")
    writer.append(schema.name, rows[:2], "w", batch=True)
    reader.catalog()
    wake.start(True, {schema.name: (0, (False, True))}, 1000)
    encoded, last, count = drive(wake)[2][schema.name][1]
    assert (last, count) == (5, 6)
    for variant in (False, True):
        assert encoded[variant] == _python(reader, schema, 0, last, variant)


# Read plain or escaped (pg_lines' SQL); with a batch in the range (the check of the seqs runs) or not.
@pytest.mark.parametrize(("stream", "batch"), [("events", True), ("events", False), ("numbers", True)])
def test_lines_that_reach_the_aggregate_out_of_order_are_left_to_the_master(
    stores, monkeypatch, caplog, stream, batch
) -> None:
    """The lines are gathered in their subquery's order, which PostgreSQL does not promise an
    aggregate: the function checks the order it took them in, and a range whose lines came in
    another order (here: a subquery that orders them backwards) is left to the master's reads,
    which is logged once."""
    writer, _reader, wake = stores
    if stream == "events":
        writer.append("events", [[f"$o{i}", "!r", "m.room.message", None, None] for i in range(3)], "w")
        if batch:
            writer.append("events", [["$b1", "!r", "t", "sk", None], ["$b2", "!r", "t", None, "$x"]], "w", batch=True)
    else:
        writer.append("numbers", [[float(i), True] for i in range(3)], "w")
        writer.append("numbers", [[None, False], [0.5, True]], "w", batch=True)
    wake.start(True, {stream: (0, (True,))}, 1000)
    assert stream in drive(wake)[2]  # in order: read by the wake-up
    ordered = wake_function_sql

    def backwards(*args):
        sql = ordered(*args)
        assert "ORDER BY t.token, t.seq OFFSET 0" in sql
        return sql.replace("ORDER BY t.token, t.seq OFFSET 0", "ORDER BY t.token DESC, t.seq DESC OFFSET 0")

    monkeypatch.setattr(pg_wake, "wake_function_sql", backwards)
    for _ in range(2):
        wake.start(True, {stream: (0, (False, True))}, 1000)  # another shape of call: a function made anew
        assert stream not in drive(wake)[2]
    assert [r.getMessage().split(";")[0] for r in caplog.records if r.name == "storage.pg_wake"] == [
        f"the wake-up's lines of {stream} reached their aggregate out of (token, seq) order"
    ]


def test_rows_whose_seqs_are_not_in_token_order_are_read_by_the_wake_up_in_order(stores, caplog) -> None:
    """A token's row whose ``seq`` is above later tokens' (rows written by hand need not follow "seq
    increases with the token"; tickline's own writes do: a row's seq is its ts, which increases with
    the token, docs/time.md) is still in ``(token, seq)``
    order as the wake-up reads it: no fallback, no warning. A check of the seqs sorted alone would
    take this range for out of order."""
    writer, reader, wake = stores
    row = ["$s", "!r", "t", None, None]
    (batch, *_) = writer.append("events", [row, row], "w", batch=True)
    writer.append("events", [row], "w")
    writer.append("events", [row, row], "w", batch=True)
    writer.append("events", [row], "w")

    def by_hand(cur) -> None:
        cur.execute(
            f"UPDATE {EVENTS.table} SET seq = (SELECT max(seq) + 100 FROM {EVENTS.table}) "
            f"WHERE seq = (SELECT max(seq) FROM {EVENTS.table} WHERE token = %s)",
            (batch,),
        )

    reader.database.write(by_hand)
    pairs = [(r[1], r[0]) for r in reader.read_rows("events", 0, 10**9, 100)]
    assert sorted(seq for _, seq in pairs) != [seq for _, seq in sorted(pairs)]  # the case named
    wake.start(True, {"events": (0, (True,))}, 1000)
    encoded, last, count = drive(wake)[2]["events"][1]
    assert count == 6 and encoded[True] == _python_lines(reader, last)
    assert not [r for r in caplog.records if r.name == "storage.pg_wake"]


def _python_lines(reader, last: int) -> bytes:
    from tests.unit.test_pg_lines import _python

    return _python(reader, EVENTS, 0, last, True)


_wake_names = (f"wakeprop{i}" for i in itertools.count())


def wake_plain(wake: PgWake, stream: str) -> int | None:
    """The wake-ups left that build the stream's lines escaped (None: plain, when its columns allow)."""
    return wake._escaped.get(stream) or None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    appends=APPENDS,
    variants=st.sampled_from([(False,), (True,), (False, True)]),
    limit=st.integers(1, 8),
)
def test_the_wake_ups_lines_are_the_server_built_lines(stores, appends, variants, limit) -> None:
    """Arbitrary rows (unicode, quotes, control characters, NULLs, every type but json, batches,
    instance names with commas and quotes): the wake-up's lines are ``storage.pg_lines``' bytes for
    every start, and it reads them exactly when the range up to the position holds at most ``limit`` rows."""
    writer, reader, wake = stores
    columns, writes = appends
    schema = StreamSchema(next(_wake_names), columns)
    writer.register_stream(schema)
    last = 0
    for rows, instance, batch in writes:
        last = max(writer.append(schema.name, rows, instance, batch=batch))
    reader.catalog()
    prefix = f"RDATA {schema.name} "

    def call(after: int) -> tuple[dict, int, dict[bool, tuple[bytes, int, int]]]:
        """The wake-up's first rows and position, and pg_lines' lines up to that position."""
        wake.start(True, {schema.name: (after, variants)}, limit)
        _times, positions, first = drive(wake)
        position = positions[schema.name]
        built: dict[bool, tuple[bytes, int, int]] = {}
        with reader._side_cursor() as cur:
            for v in variants:
                got = pg_lines.read_lines(cur, pg_lines.LineRange(schema, after, position, 10**6, prefix, v), None)
                assert got is not None  # no limit on a line's bytes
                built[v] = got
        return first, position, built

    for after in range(last):
        plain = wake_plain(wake, schema.name) is None and pg_wake.plain_text(schema)
        first, position, built = call(after)
        count = built[variants[0]][2]
        if plain and schema.name not in first and 0 < count <= limit:
            # Read plain, a value needed an escape: left to the master, and read escaped from then on
            # (the position may have moved meanwhile: the writers report theirs on their own).
            assert wake_plain(wake, schema.name) == pg_wake.ESCAPED_WAKES
            first, position, built = call(after)
            count = built[variants[0]][2]
        if count > limit:
            assert schema.name not in first  # the master reads them
            continue
        if position <= after:
            assert schema.name not in first
            continue
        expected = {v: got[0] for v, got in built.items()}
        assert first[schema.name] == (after, (expected, after if count == 0 else built[variants[0]][1], count))


PLAIN_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.one_of(st.none(), PLAIN_TEXT, st.sampled_from(["null", '"', "a\\", "\n"])), min_size=3, max_size=3),
        min_size=1,
        max_size=6,
    ),
    instance=st.sampled_from(["w", "w1", 'a"b', "a\\b", "a,b"]),
    ts=st.one_of(st.none(), st.integers(0, 2**62)),
)
def test_plain_lines_are_the_encoders_or_refused(rows, instance, ts) -> None:
    """What the plain SQL sends (values quoted as they are, NULL as ``null``) is taken exactly when it is
    the Python encoder's line: when no value (nor the instance name) needed an escape."""
    import orjson

    def sent(row: list) -> str:
        values = ",".join("null" if v is None else f'"{v}"' for v in row)
        return f"RDATA s {instance} 7 [{values}" + ("]" if ts is None else f",{ts}]")

    def encoded(row: list) -> bytes:
        return b"RDATA s %s 7 %s" % (instance.encode(), orjson.dumps(row if ts is None else [*row, ts]))

    data = "".join(sent(row) + "\n" for row in rows).encode()
    nulls = sum(v is None for row in rows for v in row)
    taken = pg_wake.plain_lines(data, len(rows), 3, nulls)
    needs_escape = any(c in instance for c in '"\\') or any(
        v is not None and (any(c in v for c in '"\\') or any(ord(c) < 32 for c in v)) for row in rows for v in row
    )
    assert taken == (not needs_escape)
    if taken:
        assert data == b"".join(encoded(row) + b"\n" for row in rows)


def test_plain_lines_from_the_server(stores) -> None:
    """Values without escapes, NULLs, a batch, both variants: read plain, the Python encoder's bytes; a value
    with a control character, a quote or a backslash is left to the master, and the stream is read
    escaped for ``ESCAPED_WAKES`` wake-ups, then plain again."""
    from tests.unit.test_pg_lines import _python

    writer, reader, wake = stores
    writer.append("events", [["$a", "!r", "t", None, None], ["$b", "!r", "t", "sk", None]], "w")
    writer.append("events", [["$c", "!r", "é☃", None, "$x"], ["$d", "!r", "t", "", None]], "w", batch=True)
    reads = {"events": (0, (False, True))}
    wake.start(True, reads, 1000)
    encoded, last, count = drive(wake)[2]["events"][1]
    assert (last, count) == (3, 4) and wake_plain(wake, "events") is None
    for variant in (False, True):
        assert encoded[variant] == _python(reader, EVENTS, 0, 3, variant)
    assert encoded[False].count(b" batch ") == 1
    for value in ("\x01", 'say "hi"', "back\\slash"):
        writer.append("events", [["$e", "!r", "t", value, None]], "w")
        wake._escaped.clear()
        wake.start(True, {"events": (3, (True,))}, 1000)
        first = drive(wake)[2]
        assert "events" not in first and wake_plain(wake, "events") == pg_wake.ESCAPED_WAKES
        wake.start(True, {"events": (3, (True,))}, 1000)
        encoded, last, _count = drive(wake)[2]["events"][1]
        assert encoded[True] == _python(reader, EVENTS, 3, last, True)
    wake._escaped["events"] = 1  # the last escaped wake-up
    wake.start(True, {"events": (last, (False,))}, 1000)
    drive(wake)
    assert wake_plain(wake, "events") is None
    writer.append("events", [["$f", "!r", "t", None, None]], "w")
    wake.start(True, {"events": (last, (False,))}, 1000)
    assert drive(wake)[2]["events"][1][0][False] == _python(reader, EVENTS, last, last + 1, False)


def test_a_text_stream_of_more_columns_than_a_function_takes_is_read_escaped(pg_url) -> None:
    """``num_nulls`` (the plain read's NULL count) takes at most 100 arguments: a wider text stream is
    read escaped, and the one wake-up function that serves every stream keeps working."""
    from tests.unit.test_pg_lines import _python

    wide = StreamSchema("wide", tuple(Column(f"c{i}", "text", True) for i in range(101)))
    narrow = StreamSchema("narrow", (Column("a", "text"),))
    writer = open_store(pg_url)
    reader = pg_store(open_store(pg_url))
    try:
        writer.register_stream(wide)
        writer.register_stream(narrow)
        reader.catalog()
        writer.append("wide", [["x"] * 100 + [None]], "w")
        writer.append("narrow", [["y"]], "w")
        wake = reader.open_wake()
        try:
            wake.start(True, {"wide": (0, (True,)), "narrow": (0, (True,))}, 1000)
            first = drive(wake)[2]
        finally:
            wake.close()
        assert first["wide"][1][0][True] == _python(reader, wide, 0, 1, True)
        assert first["narrow"][1][0][True] == _python(reader, narrow, 0, 2, True)
    finally:
        writer.close()
        reader.close()


@settings(max_examples=200, deadline=None)
@given(chunk=st.binary(max_size=200), copies=st.integers(1, 100))
def test_escaped_bytes_are_counted_alike_below_and_above_the_numpy_size(chunk, copies) -> None:
    """Small answers are counted by ``bytes.translate``, large ones by numpy: the same count at every size
    (quotes, backslashes and control characters; every other byte, UTF-8 included, not)."""
    data = chunk * copies
    assert pg_wake.escaped_bytes(data) == len(data) - len(data.translate(None, b'"\\' + bytes(range(32))))


def test_a_large_plain_answer_is_taken_or_refused_by_its_count() -> None:
    """A 1000-row answer (counted by numpy): taken as it is, refused with one quote, backslash or control
    character more in a value."""
    line = 'RDATA events w 7 ["$a:é☃","!r","m.room",null]\n'.encode()
    data = line * 1000
    assert len(data) >= pg_wake._NUMPY_COUNT_BYTES
    assert pg_wake.plain_lines(data, 1000, 4, 1000)
    for extra in (b'"', b"\\", b"\t", b"\x00", b"\x1f"):
        spoiled = data.replace(b"$a", b"$" + extra, 1)
        assert not pg_wake.plain_lines(spoiled, 1000, 4, 1000)


@pytest.mark.parametrize(("encoding", "raw"), [("UTF8", True), ("SQL_ASCII", False)])
def test_the_answer_is_taken_as_bytes_only_from_a_utf8_database(pg_server, monkeypatch, encoding, raw) -> None:
    """A UTF-8 session on a UTF-8 database sends valid UTF-8 only: its lines are taken as sent. On a
    SQL_ASCII database the server passes any bytes through unconverted, even to a session that asked
    for UTF-8 (here by libpq's PGCLIENTENCODING), so they are decoded (which refuses what is not
    UTF-8), as before the bytes were taken."""
    monkeypatch.setenv("PGCLIENTENCODING", "UTF8")
    name = f"wake_{encoding.lower()}_{next(_DATABASES)}"
    admin = psycopg2.connect(pg_server.url())
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} ENCODING '{encoding}' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'")
    store = pg_store(open_store(pg_server.url(name)))
    wake = pg_wake.open_wake(store)
    try:
        assert wake._conn.encoding == "UTF8"
        assert wake._raw_text is raw
        # Text (oid 25) comes back as the bytes sent only on the raw path.
        assert (wake._conn.string_types.get(25) is psycopg2.extensions.BYTES) is raw
    finally:
        wake.close()
        store.close()
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE {name}")
        admin.close()


_DATABASES = itertools.count()


def test_a_new_wake_up_connection_starts_no_import_thread_once_numpy_is_imported(stores, monkeypatch) -> None:
    """numpy is imported on a thread when the first wake-up connection opens; the connections opened
    after a lost one (the master's slow loop opens a new one) start no thread for it."""
    import numpy  # noqa: F401  (what the first connection's thread did)

    started: list[str] = []
    real_start = threading.Thread.start

    def recording_start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    wake = stores[1].open_wake()
    wake.close()
    assert "tickline-import" not in started
