-- Issue 30 (decision 0051): what a node reports of a replica's box, beside
-- its unit state: why its last process ended when the agent knows more than
-- its exit code (`oom_killed`), how many times it was OOM-killed since it was
-- declared, the uid it runs as and the bytes in its module's data volume on
-- the node. Shown per replica in the module view.
ALTER TABLE inventory.assignments
    ADD COLUMN reason text,
    ADD COLUMN oom_kills bigint NOT NULL DEFAULT 0,
    ADD COLUMN uid bigint,
    ADD COLUMN data_bytes bigint;
