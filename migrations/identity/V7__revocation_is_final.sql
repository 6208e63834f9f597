-- Issue 39: revocation is final until an admin re-admits the node
-- (docs/decisions/0050-revocation-is-final.md). A node revoked that never
-- enrolled through identity (added by `mesh-bundle node-add`) is recorded
-- too, without a key, so that node-add and join tokens can refuse it; and
-- who re-admitted a node, when, is kept beside its revocation.
ALTER TABLE identity.nodes ALTER COLUMN public_key DROP NOT NULL;
ALTER TABLE identity.nodes ADD COLUMN readmitted_at timestamptz;
ALTER TABLE identity.nodes ADD COLUMN readmitted_by text;
