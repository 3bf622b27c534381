-- A worker's applied token per stream, written in the same transaction as the
-- effects of the rows it covers.
CREATE TABLE tickline_applied (
    stream TEXT PRIMARY KEY,
    token BIGINT NOT NULL
);
