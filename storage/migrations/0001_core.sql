-- The catalog of streams: name and declared columns (JSON), one row per stream.
CREATE TABLE tickline_streams (
    name TEXT PRIMARY KEY,
    columns TEXT NOT NULL
);

-- The highest token allocated per stream; tokens are taken from here inside
-- the transaction that writes the rows.
CREATE TABLE tickline_stream_heads (
    stream TEXT PRIMARY KEY,
    token BIGINT NOT NULL
);

-- The timestamp oracle's high-water mark: the last timestamp handed out.
CREATE TABLE tickline_tso (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    last_ts BIGINT NOT NULL
);
INSERT INTO tickline_tso (id, last_ts) VALUES (1, 0);
