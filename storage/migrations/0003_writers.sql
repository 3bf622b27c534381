-- Writers of each stream and their positions (multi-writer timeticks). A
-- writer is one process writing under one instance name: instance_name holds
-- "<instance>/<host>:<pid>:<nonce>". Its position is the
-- highest token below which all of the writer's own allocations have
-- committed. A writer registers (alive, with a new epoch) before it allocates;
-- one that stops reporting is marked dead and its epoch moves on, which fences
-- off its late commits.
CREATE TABLE tickline_writers (
    stream TEXT NOT NULL,
    instance_name TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    position BIGINT NOT NULL,
    heartbeat_ms BIGINT NOT NULL,
    alive BOOLEAN NOT NULL,
    PRIMARY KEY (stream, instance_name)
);
