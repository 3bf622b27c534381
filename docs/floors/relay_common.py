"""What the floors' relay processes share: their connections, their sockets, their reading of lines.

Only the standard library and psycopg2, no module of the project (unlike ``floors_common``, which
the drivers use), so that a relay process carries nothing but its job.
"""

import io
import select
import socket

import psycopg2

COLUMNS = "token, instance_name, ts, event_id, room_id, type, state_key, redacts"
# The latency floors' apply: the row and the applied token in one prepared statement.
PREPARE_APPLY = (
    "PREPARE ins (bigint, text, bigint, text, text, text, text, text) AS WITH u AS (UPDATE applied SET token = $1) "
    f"INSERT INTO replicated_events ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
EXECUTE_APPLY = "EXECUTE ins (%s, %s, %s, %s, %s, %s, %s, %s)"


def apply_connection(dst, autocommit, prepare=False):
    """A connection to the target and its cursor, ``synchronous_commit`` off (as tickline's worker and a
    subscription's apply worker); ``prepare``: :data:`PREPARE_APPLY` made on it."""
    conn = psycopg2.connect(dst)
    conn.autocommit = autocommit
    cur = conn.cursor()
    cur.execute("SET synchronous_commit = off")
    if prepare:
        cur.execute(PREPARE_APPLY)
    if not autocommit:
        conn.commit()
    return conn, cur


def listen_connection(src):
    """An autocommit connection to the source that ``LISTEN``s on the writer's channel."""
    conn = psycopg2.connect(src)
    conn.autocommit = True
    conn.cursor().execute("LISTEN ch")
    return conn


def read_cursor(src):
    """An autocommit cursor on the source for the "master"'s reads."""
    conn = psycopg2.connect(src)
    conn.autocommit = True
    return conn.cursor()


def master_connections(src, port):
    """An end-to-end "master"'s connections: the ``LISTEN`` one, a read cursor, the socket to the
    "worker"; then ``ready``."""
    listen, cursor, sock = listen_connection(src), read_cursor(src), connect(port)
    print("ready", flush=True)
    return listen, cursor, sock


def notified_ranges(listen):
    """``(after, top)``, the new tokens, for each wake-up by the writer's notifications (payload: its last token)."""
    last = 0
    while True:
        select.select([listen], [], [])
        listen.poll()
        if not listen.notifies:
            continue
        top = max(int(n.payload) for n in listen.notifies)
        listen.notifies.clear()
        yield last, top
        last = top


def accept_master(port, nodelay=False):
    """Listen on ``port``, say ``ready`` (the driver then starts the "master"), and take its connection."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(1)
    print("ready", flush=True)
    s, _ = srv.accept()
    if nodelay:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def connect(port):
    """A connection to ``port`` on loopback, ``TCP_NODELAY`` (as tickline's connections)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def copy_escape(value):
    """A JSON value as ``COPY`` text: ``\\N`` for null, else its text with ``COPY``'s escapes."""
    if value is None:
        return "\\N"
    text = str(value)
    if "\\" in text or "\t" in text or "\n" in text or "\r" in text:
        text = text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    return text


def received_lines(sock, size):
    """Each whole line received on ``sock`` (reads of ``size`` bytes), until the peer closes."""
    buf = b""
    while True:
        data = sock.recv(size)
        if not data:
            return
        buf += data
        *lines, buf = buf.split(b"\n")
        yield from lines


def copy_groups(sock, conn, cur, text_of):
    """The end-to-end JSON floors' apply: the lines up to each ``END <token>`` line made ``COPY`` text
    by ``text_of(lines)``, copied with the applied token in one transaction."""
    pending = []
    for line in received_lines(sock, 262144):
        if line.startswith(b"END "):
            copy_rows(conn, cur, text_of(pending), int(line[4:]))
            pending = []
        else:
            pending.append(line)


def copy_rows(conn, cur, text, top):
    """``text`` (``COPY`` text of replicated_events' rows) copied and the applied token moved to ``top``, one transaction."""
    cur.copy_expert(f"COPY replicated_events ({COLUMNS}) FROM STDIN", io.BytesIO(text))
    cur.execute("UPDATE applied SET token = %s", (top,))
    conn.commit()
