-- SQLite stream tables have no token or ts index: rows are found by binary
-- search over the rowid, in which tickline appends them in token and ts
-- order (storage/sqlite_order.py). A stream with a row out of that order
-- (written by hand, say) is marked here by the table's triggers and read
-- through indexes again. PostgreSQL never writes it (its stream tables keep
-- their (token, seq) index).
CREATE TABLE tickline_unordered (
    stream TEXT PRIMARY KEY
);
