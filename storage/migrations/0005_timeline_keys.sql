-- Timeline indexes with (nearly) distinct keys (docs/timeline.md, docs/benchmarks.md).
-- Many messages share a due time, a consumer or a group; as duplicates, their
-- entries were merged in posting lists, and PostgreSQL marks an index entry
-- dead only when every row of its posting list is dead: the lease scan kept
-- visiting rows leased long ago. With the timestamp (and the id) in the key,
-- each entry is its own; the due index also gives ties a stable order (ts, id).
DROP INDEX tickline_timeline_due;
CREATE INDEX tickline_timeline_due ON tickline_timeline (topic, bucket, ts, id) WHERE deleted_ms IS NULL;
DROP INDEX tickline_timeline_consumer;
-- Leases by consumer, earliest end first (a consumer that comes back).
CREATE INDEX tickline_timeline_consumer ON tickline_timeline (topic, consumer, ts) WHERE consumer IS NOT NULL AND deleted_ms IS NULL;
DROP INDEX tickline_timeline_group;
CREATE INDEX tickline_timeline_group ON tickline_timeline (topic, producer_group, ts) WHERE deleted_ms IS NULL;
