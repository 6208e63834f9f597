-- Issue 29, point 3: OIDC trust for automation. A trust names an issuer, the
-- audience and subject pattern its ID tokens must carry, and the role of the
-- short-lived API token (an hour at most) given for one.
CREATE TABLE identity.trusts (
    name text PRIMARY KEY,
    issuer text NOT NULL,
    audience text NOT NULL,
    subject text NOT NULL,
    role text NOT NULL CHECK (role IN ('admin', 'operator', 'viewer')),
    ttl_secs integer NOT NULL CHECK (ttl_secs BETWEEN 60 AND 3600),
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL
);

-- A token given for an ID token names its trust and the token's subject; a
-- trust deleted or changed revokes the tokens it gave (no foreign key: the
-- token's row outlives its trust, for the record).
ALTER TABLE identity.tokens ADD COLUMN trust text;
ALTER TABLE identity.tokens ADD COLUMN subject text;
CREATE INDEX tokens_trust ON identity.tokens (trust) WHERE trust IS NOT NULL AND revoked_at IS NULL;
