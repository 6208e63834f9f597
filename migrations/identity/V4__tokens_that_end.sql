-- Issue 29, point 2: operators' API tokens end. Each carries its expiry and
-- when it was last used; a rotated token names the one it replaced.
ALTER TABLE identity.tokens ADD COLUMN expires_at timestamptz;
ALTER TABLE identity.tokens ADD COLUMN last_used_at timestamptz;
ALTER TABLE identity.tokens ADD COLUMN rotated_from uuid REFERENCES identity.tokens (id);
-- Tokens made before the upgrade keep working for the default lifetime of a
-- new one, counted from the upgrade (none is cut off by it).
UPDATE identity.tokens SET expires_at = now() + interval '90 days';
ALTER TABLE identity.tokens ALTER COLUMN expires_at SET NOT NULL;
