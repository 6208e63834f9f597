-- Issue 30 (decision 0051): a unit's OOM kills since it was declared, as its
-- node reports them (`units`); `oom_kills` OOM kills raise `unit_oom_killed`.
ALTER TABLE observability.units ADD COLUMN oom_kills bigint NOT NULL DEFAULT 0;
