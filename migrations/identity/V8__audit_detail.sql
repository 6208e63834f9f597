-- Issue 30 (decision 0051): an audit entry may say what its route alone does
-- not (`detail`), e.g. that the module written runs as root. Older entries
-- have none. Adding a column rewrites no row: the log stays append-only.
ALTER TABLE identity.audit ADD COLUMN detail text;
