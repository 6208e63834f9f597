-- Operator-held signing keys (issue 29, point 4; docs/decisions/0048): the
-- keys whose artifact signatures nodes trust, added and removed by admins;
-- the signatures operators uploaded; and an artifact the controller did not
-- sign at push time (the fleet does not trust its key) has no signed_by.

CREATE TABLE delivery.signing_keys (
    name text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9._-]{0,62}$'),
    -- Ed25519 public key, 64 lowercase hex digits.
    key text NOT NULL UNIQUE CHECK (key ~ '^[0-9a-f]{64}$'),
    added_by text NOT NULL,
    added_at timestamptz NOT NULL DEFAULT now()
);

-- Signatures uploaded for artifacts (each verified against a signing key
-- when it came; the registry holds them beside the artifact). A key that is
-- removed later leaves its rows: they say who signed what, not what is trusted.
CREATE TABLE delivery.artifact_signatures (
    digest text NOT NULL REFERENCES delivery.artifacts (digest),
    key text NOT NULL CHECK (key ~ '^[0-9a-f]{64}$'),
    -- The signing key's name when the signature was uploaded.
    key_name text NOT NULL,
    signature text NOT NULL CHECK (signature ~ '^[0-9a-f]{128}$'),
    uploaded_by text NOT NULL,
    uploaded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (digest, key)
);

ALTER TABLE delivery.artifacts ALTER COLUMN signed_by DROP NOT NULL;
