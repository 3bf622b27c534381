-- Timeline indexes with distinct keys, and the group index without leased
-- messages (docs/timeline.md, docs/benchmarks.md "Timeline").
-- Many messages share a due time, a lease end, a consumer or a group. As
-- duplicates, their index entries were merged in posting lists, costly to
-- insert into (every lease and every delete inserts new entries), and
-- PostgreSQL marks an entry dead only when every row of its posting list is
-- dead, so the lease scan kept visiting rows leased long ago. With the id in
-- each key, every entry is its own; the due index also gives ties a stable
-- order (ts, id).
DROP INDEX tickline_timeline_due;
CREATE INDEX tickline_timeline_due ON tickline_timeline (topic, bucket, ts, id) WHERE deleted_ms IS NULL;
DROP INDEX tickline_timeline_consumer;
-- Leases by consumer, earliest end first (a consumer that comes back).
CREATE INDEX tickline_timeline_consumer ON tickline_timeline (topic, consumer, ts, id) WHERE consumer IS NOT NULL AND deleted_ms IS NULL;
DROP INDEX tickline_timeline_group;
-- Messages by producer group that are not leased (what the group may still
-- move or cancel; leased ones are found by consumer). A lease adds no entry here.
CREATE INDEX tickline_timeline_group ON tickline_timeline (topic, producer_group, ts, id) WHERE consumer IS NULL AND deleted_ms IS NULL;
DROP INDEX tickline_timeline_deleted;
-- Marked messages for the batch remover, oldest mark first.
CREATE INDEX tickline_timeline_deleted ON tickline_timeline (deleted_ms, topic, id) WHERE deleted_ms IS NOT NULL;
