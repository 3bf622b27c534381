-- Timeline topics: scheduled messages with leases (docs/timeline.md).
-- A message's place on the timeline is ts (Unix ms on the master's clock).
-- Its status follows from ts, consumer and now: available (ts <= now),
-- waiting (ts > now, no consumer), processing (ts > now, a consumer: the
-- lease ends at ts). The lease IS the timestamp: no sweeper, no second clock.
-- A deleted message is marked (deleted_ms) and removed later in batches; a
-- marked row is no message any more (invisible to every operation).
CREATE TABLE tickline_timeline (
    topic TEXT NOT NULL,
    id TEXT NOT NULL,
    ts BIGINT NOT NULL,
    body TEXT NOT NULL,
    producer_group TEXT NOT NULL,
    consumer TEXT,
    bucket INTEGER NOT NULL,
    version BIGINT NOT NULL,
    created_ms BIGINT NOT NULL,
    deleted_ms BIGINT,
    PRIMARY KEY (topic, id)
);
-- Due messages by (bucket, timestamp): the master's lease scan and next due time.
CREATE INDEX tickline_timeline_due ON tickline_timeline (topic, bucket, ts) WHERE deleted_ms IS NULL;
-- Leases by consumer: a consumer that comes back gets its active leases first.
CREATE INDEX tickline_timeline_consumer ON tickline_timeline (topic, consumer) WHERE consumer IS NOT NULL AND deleted_ms IS NULL;
-- Messages by producer group (ownership control, listing).
CREATE INDEX tickline_timeline_group ON tickline_timeline (topic, producer_group) WHERE deleted_ms IS NULL;
-- Marked messages for the batch remover.
CREATE INDEX tickline_timeline_deleted ON tickline_timeline (deleted_ms) WHERE deleted_ms IS NOT NULL;
