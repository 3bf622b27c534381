"""Stream schemas: a stream's name and typed columns, row validation and DDL.

Every stream is stored in a table ``stream_<name>`` with a ``seq`` (insertion
order, which orders the rows of one token), ``token``, ``instance_name``,
``ts`` and then the declared columns in order. On SQLite the table has two
more columns: ``row_line`` (:data:`ROW_LINE_COLUMN`), the row's whole
``RDATA`` line as the master sends it (``RDATA <stream> <instance> <token>
<values>\n``, the values the JSON array of :meth:`StreamSchema.values_encoder`,
without ``ts``), written by the writer in the row's own transaction, so that
the master's reads only concatenate stored lines; and ``row_json``
(:data:`ROW_JSON_COLUMN`), the values' JSON array alone, which tickline wrote
for a while before ``row_line`` (now NULL in the rows it writes; the upgrade
moves it into ``row_line``).
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attr
import orjson

# A stream's tables and their indexes (replicated_<name>_token, stream_<name>_token_seq)
# must fit PostgreSQL's 63-byte identifiers: 46 characters at most.
STREAM_NAME = re.compile(r"[a-z][a-z0-9_]{0,45}")
COLUMN_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")
# SQLite: each row's values as the JSON array RDATA sends (see the module doc and docs/architecture.md).
ROW_JSON_COLUMN = "row_json"
ROW_LINE_COLUMN = "row_line"
RESERVED_COLUMNS = frozenset({"seq", "token", "instance_name", "ts", ROW_JSON_COLUMN, ROW_LINE_COLUMN})
# Column names go into SQL unquoted, so a name that is an SQL keyword is refused:
# every word that fails as a column name in the statements tickline runs, on
# PostgreSQL (its reserved keywords: categories R and T of pg_get_keywords())
# or on SQLite (the keywords it does not take as identifiers). Found by trying
# every keyword of both; tests/unit/test_config_validation.py checks it again.
_SQL_KEYWORDS = """
    add all alter analyse analyze and any array as asc asymmetric authorization autoincrement
    between binary both case cast check collate collation column commit concurrently constraint
    create cross current_catalog current_date current_role current_schema current_time
    current_timestamp current_user default deferrable delete desc distinct do drop else end
    escape except exists false fetch for foreign freeze from full grant group having ilike in
    index initially inner insert intersect into is isnull join lateral leading left like limit
    localtime localtimestamp natural not nothing notnull null offset on only or order outer
    overlaps placing primary raise references returning right select session_user set similar
    some symmetric table tablesample then to trailing transaction true union unique update user
    using values variadic verbose when where window with
    """
SQL_KEYWORDS = frozenset(_SQL_KEYWORDS.split())
# Instance and server names travel as one word of the wire protocol.
MAX_NAME_BYTES = 200
NAME_WORD = re.compile(rf"[!-~]{{1,{MAX_NAME_BYTES}}}")

# Declared type -> (SQLite type, PostgreSQL type)
COLUMN_TYPES: dict[str, tuple[str, str]] = {
    "text": ("TEXT", "TEXT"),
    "bigint": ("BIGINT", "BIGINT"),
    "double": ("DOUBLE PRECISION", "DOUBLE PRECISION"),
    "boolean": ("BOOLEAN", "BOOLEAN"),
    "json": ("TEXT", "JSONB"),
}
# A bigint column, a token and a timestamp are signed 64-bit integers in both databases.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SchemaError(ValueError):
    """A stream or column declaration that is not valid."""


class RowError(ValueError):
    """A row that does not fit its stream's columns (or cannot be delivered).

    ``reason`` says what was wrong; ``index``, when known, is the row's
    position among the rows of the write (0-based), and the message then
    starts with ``row <index + 1>: ``.
    """

    def __init__(self, reason: str, index: int | None = None) -> None:
        super().__init__(reason if index is None else f"row {index + 1}: {reason}")
        self.reason = reason
        self.index = index


def check_instance_name(name: object) -> str:
    """A writer's instance name: one word of printable ASCII (it is sent in RDATA)."""
    if not isinstance(name, str) or not NAME_WORD.fullmatch(name):
        raise RowError(f"bad instance name {name!r}: one word of printable ASCII, no spaces")
    return name


def _short(value: Any) -> str:
    """A bounded repr for messages (a hostile value may be huge or deeply nested)."""
    return reprlib.repr(value)


def _check_text(value: str, stream: str, column: str) -> str:
    if "\x00" in value:
        raise RowError(f"stream {stream!r}: column {column!r}: text may not contain NUL (\\u0000)")
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RowError(f"stream {stream!r}: column {column!r}: text is not valid Unicode (a lone surrogate)") from None
    return value


def _contains_nul(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


@attr.s(slots=True, frozen=True, auto_attribs=True, cache_hash=True)
class Column:
    name: str
    type: str
    nullable: bool = False

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not COLUMN_NAME.fullmatch(self.name):
            raise SchemaError(
                f"bad column name {self.name!r}: lower-case letters, digits and _ , starting with a letter"
            )
        if self.name in RESERVED_COLUMNS:
            raise SchemaError(f"column name {self.name!r} is reserved")
        if self.name in SQL_KEYWORDS:
            raise SchemaError(
                f"column name {self.name!r} is an SQL keyword, which tickline does not quote: "
                f"choose another name (such as {self.name + '_'!r})"
            )
        if self.type not in COLUMN_TYPES:
            raise SchemaError(f"column {self.name!r} has unknown type {self.type!r} (known: {', '.join(COLUMN_TYPES)})")
        if not isinstance(self.nullable, bool):
            raise SchemaError(f"column {self.name!r}: nullable must be true or false")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "nullable": self.nullable}

    def check(self, value: Any, stream: str) -> Any:
        """The value as stored, or RowError naming the column."""
        if value is None:
            if self.nullable:
                return None
            raise RowError(f"stream {stream!r}: column {self.name!r} may not be null")
        kind = self.type
        if kind == "text":
            if isinstance(value, str):
                return _check_text(value, stream, self.name)
        elif kind == "bigint":
            if isinstance(value, int) and not isinstance(value, bool):
                if INT64_MIN <= value <= INT64_MAX:
                    return value
                raise RowError(f"stream {stream!r}: column {self.name!r}: {_short(value)} does not fit in 64 bits")
        elif kind == "double":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    number = float(value)
                except OverflowError:
                    number = math.inf
                if math.isfinite(number):
                    return number
                raise RowError(f"stream {stream!r}: column {self.name!r}: {_short(value)} is not a finite number")
        elif kind == "boolean":
            if isinstance(value, bool):
                return value
        elif kind == "json":
            try:
                text = orjson.dumps(value).decode("utf-8")
            except TypeError as e:  # orjson.JSONEncodeError: an object JSON cannot hold, or nested too deep
                why = "nested too deeply" if "ecursion" in str(e) else str(e)
                raise RowError(f"stream {stream!r}: column {self.name!r}: not storable as JSON ({why})") from None
            if "\\u0000" in text and _contains_nul(value):
                raise RowError(f"stream {stream!r}: column {self.name!r}: JSON strings may not contain NUL (\\u0000)")
            return text
        raise RowError(
            f"stream {stream!r}: column {self.name!r} expects {kind}, got {type(value).__name__} {_short(value)}"
        )


def replicated_token_index(dialect: str) -> str:
    """The index clause of a replicated table's ``token`` index (what follows ``ON <table>``).

    PostgreSQL: BRIN (see :meth:`StreamSchema.create_replicated_table_sql`), with
    ``autosummarize``: a block range filled is summarized soon (autovacuum's work item),
    not only at the table's next vacuum, so a range read scans few unsummarized pages.
    """
    return "USING brin (token) WITH (autosummarize = on)" if dialect == "postgresql" else "(token)"


@attr.s(slots=True, frozen=True, auto_attribs=True, cache_hash=True)
class StreamSchema:
    name: str
    columns: tuple[Column, ...]

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not STREAM_NAME.fullmatch(self.name):
            raise SchemaError(
                f"bad stream name {self.name!r}: lower-case letters, digits and _ , starting with a letter, "
                "at most 46 characters"
            )
        if not self.columns:
            raise SchemaError(f"stream {self.name!r} has no columns")
        names = [c.name for c in self.columns]
        for name in names:
            if names.count(name) > 1:
                raise SchemaError(f"stream {self.name!r} declares column {name!r} twice")

    @property
    def table(self) -> str:
        return f"stream_{self.name}"

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def json_columns(self) -> tuple[int, ...]:
        """Positions of the JSON columns (stored as text, sent as JSON)."""
        return tuple(i for i, c in enumerate(self.columns) if c.type == "json")

    @property
    def double_columns(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.columns) if c.type == "double")

    @property
    def boolean_columns(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.columns) if c.type == "boolean")

    def values_encoder(self) -> Callable[[Sequence[Any]], bytes]:
        """A function: the stream's values (checked, or as stored) -> the row's JSON array, as RDATA carries it.

        The one definition of a row's JSON on the wire (without ``ts``):
        orjson's output of the values in column order, JSON columns (stored as
        JSON text) embedded as they are, booleans (SQLite stores 0/1) as
        ``true``/``false``. Used by SQLite's writer for ``row_line`` and by the
        master's encoder of stored rows (``replication.rows.row_encoder``).
        """
        json_columns = self.json_columns
        boolean_columns = self.boolean_columns
        dumps = orjson.dumps
        fragment = orjson.Fragment
        if not json_columns and not boolean_columns:
            # orjson writes a tuple as a JSON array: no list copy needed.
            return dumps

        def encode(values: Sequence[Any]) -> bytes:
            items = list(values)
            for i in json_columns:
                if items[i] is not None:
                    items[i] = fragment(items[i])
            for i in boolean_columns:
                if items[i] is not None:
                    items[i] = bool(items[i])
            return dumps(items)

        return encode

    def columns_json(self) -> str:
        return orjson.dumps([c.to_json() for c in self.columns]).decode("utf-8")

    @classmethod
    def from_columns_json(cls, name: str, text: str) -> StreamSchema:
        return cls(name, tuple(Column(**c) for c in orjson.loads(text)))

    def in_column_order(self) -> Callable[[Any], Any]:
        """A function: a row given as an object with only this stream's columns -> its values in column order.

        Missing columns become None. Any other row comes back unchanged, for
        :meth:`check_row` to name what is wrong with it. Writers check rows in
        column order on their fast path: an object converted here takes it.
        """
        names = self.column_names
        known = frozenset(names)

        def order(row: Any) -> Any:
            if type(row) is dict and known.issuperset(row):
                get = row.get
                return tuple([get(name) for name in names])
            return row

        return order

    def check_row(self, row: Sequence[Any] | Mapping[str, Any]) -> tuple[Any, ...]:
        """Validate one row (a list in column order, or an object by column name)."""
        if isinstance(row, Mapping):
            unknown = sorted(set(row) - set(self.column_names))
            if unknown:
                raise RowError(f"stream {self.name!r} has no column {unknown[0]!r}")
            values: Sequence[Any] = [row.get(c.name) for c in self.columns]
        elif isinstance(row, (list, tuple)):
            if len(row) != len(self.columns):
                raise RowError(
                    f"stream {self.name!r} expects {len(self.columns)} values "
                    f"({', '.join(self.column_names)}), got {len(row)}"
                )
            values = row
        else:
            raise RowError(f"stream {self.name!r}: a row must be a JSON array or object, got {type(row).__name__}")
        return tuple(c.check(v, self.name) for c, v in zip(self.columns, values, strict=False))

    @property
    def replicated_table(self) -> str:
        return f"replicated_{self.name}"

    def _column_ddl(self, dialect: str) -> str:
        index = 0 if dialect == "sqlite" else 1
        return ",\n    ".join(
            f"{c.name} {COLUMN_TYPES[c.type][index]}{'' if c.nullable else ' NOT NULL'}" for c in self.columns
        )

    def create_replicated_table_sql(self, dialect: str) -> list[str]:
        """A worker's copy of the stream: the columns plus token, instance_name, ts.

        Indexed on ``token`` for the reads by token range (snapshots). On
        PostgreSQL by a BRIN index: rows are applied in token order, so each
        block range holds a narrow span of tokens, and an insert costs the
        apply's backend about a third of a B-tree's (a ``COPY`` of 1000-row
        groups, backend CPU per row: 1.18 µs without an index, 1.33 BRIN,
        1.70 B-tree; docs/benchmarks.md, wk3). A table made before keeps its
        B-tree (same name: not created again).
        """
        table = self.replicated_table
        return [
            f"CREATE TABLE IF NOT EXISTS {table} (\n    token BIGINT NOT NULL,\n"
            f"    instance_name TEXT NOT NULL,\n    ts BIGINT NOT NULL,\n    {self._column_ddl(dialect)}\n)",
            f"CREATE INDEX IF NOT EXISTS {table}_token ON {table} {replicated_token_index(dialect)}",
        ]

    def insert_replicated_sql(self, placeholder: str) -> str:
        names = ", ".join(("token", "instance_name", "ts", *self.column_names))
        marks = ", ".join([placeholder] * (3 + len(self.columns)))
        return f"INSERT INTO {self.replicated_table} ({names}) VALUES ({marks})"

    def insert_replicated_values_sql(self) -> str:
        """For psycopg2's ``execute_values``: one ``VALUES %s`` for many rows."""
        names = ", ".join(("token", "instance_name", "ts", *self.column_names))
        return f"INSERT INTO {self.replicated_table} ({names}) VALUES %s"

    def replicated_values_template(self) -> str:
        """``execute_values``' template for one row of :meth:`insert_replicated_values_sql`.

        A double is cast where it stands: psycopg2 writes ``-0.0``, which alone
        is a ``numeric`` (no negative zero); ``-0.0::DOUBLE PRECISION`` negates
        the double 0.0 and keeps the sign.
        """
        casts = ["%s::DOUBLE PRECISION" if c.type == "double" else "%s" for c in self.columns]
        return "(" + ", ".join(["%s", "%s", "%s", *casts]) + ")"

    def replicated_range_sql(self, after: int | None, upto: int, alias: str = "snap") -> str:
        """A subquery of the rows of ``replicated_<stream>`` with ``after < token <= upto``.

        For Spark's JDBC ``dbtable`` (a snapshot): the columns in the replicated
        table's order; tokens are integers, formatted here (no parameters).
        """
        names = ", ".join(("token", "instance_name", "ts", *self.column_names))
        where = f"token <= {int(upto)}" if after is None else f"token > {int(after)} AND token <= {int(upto)}"
        return f"(SELECT {names} FROM {self.replicated_table} WHERE {where}) AS {alias}"

    def create_table_sql(self, dialect: str) -> list[str]:
        """The stream's table and only the indexes reads need.

        Rows are read by token range in ``(token, seq)`` order (the fan-out and
        replays) and looked up by ``ts`` (start at a time). On PostgreSQL the
        ``(token, seq)`` index serves every read, the lookup by ``ts``
        included (a binary search over it, ``storage.time_index``, since
        ``ts`` increases in that order): one index per row written. On SQLite
        ``seq`` is the rowid and the table has no index at all: tickline
        appends rows in token and ``ts`` order, so both are binary searches
        over the rowid (``storage.sqlite_order``, whose triggers the store
        adds: a row out of that order marks the stream, which is then read
        through indexes again).
        """
        cols = self._column_ddl(dialect)
        if dialect == "sqlite":
            # row_json, row_line: see the module doc; row_line is NULL only in rows
            # written by a tickline older than the column (read with a fallback).
            return [
                f"CREATE TABLE {self.table} (\n    seq INTEGER PRIMARY KEY,\n    token BIGINT NOT NULL,\n"
                f"    instance_name TEXT NOT NULL,\n    ts BIGINT NOT NULL,\n    {cols},\n"
                f"    {ROW_JSON_COLUMN} BLOB,\n    {ROW_LINE_COLUMN} BLOB\n)",
                self.stale_lines_trigger_sql(),
            ]
        return [
            f"CREATE TABLE {self.table} (\n    seq BIGSERIAL,\n    token BIGINT NOT NULL,\n"
            f"    instance_name TEXT NOT NULL,\n    ts BIGINT NOT NULL,\n    {cols}\n)",
            f"CREATE INDEX {self.table}_token ON {self.table} (token, seq)",
        ]

    def stale_lines_trigger_sql(self) -> str:
        """SQLite: a row changed by hand (its token, writer or values) loses its stored line and JSON.

        ``row_line`` carries the token, the writer and the values as written;
        tickline never updates a row, but a hand-made ``UPDATE`` would leave
        them stale: this trigger sets both to NULL, and the row is then read
        from its columns (``SqliteStreamStore._line``). Inserts pay nothing.
        """
        columns = ", ".join(("token", "instance_name", *self.column_names))
        return (
            f"CREATE TRIGGER IF NOT EXISTS {self.table}_stale_line AFTER UPDATE OF {columns} ON {self.table} "
            f"BEGIN UPDATE {self.table} SET {ROW_JSON_COLUMN} = NULL, {ROW_LINE_COLUMN} = NULL "
            "WHERE seq = NEW.seq; END"
        )

    def upgrade_table_sql(self, dialect: str) -> list[str]:
        """What brings a stream table created by an earlier version to :meth:`create_table_sql`'s shape.

        Idempotent (run on every migrate). PostgreSQL stream tables had a
        ``ts`` index until the lookup by time became a search of the
        ``(token, seq)`` index: it is dropped. SQLite's upgrade (the
        ``row_json`` and ``row_line`` columns, filled by the Python encoder) is
        not plain SQL: ``SqliteStreamStore.migrate`` does it (``add_row_lines``).
        """
        if dialect == "sqlite":
            return []
        return [f"DROP INDEX IF EXISTS {self.table}_ts"]
