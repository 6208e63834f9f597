-- Node identities: the public key each node enrolled with, who enrolled it, and
-- whether it is revoked. A re-enrolment (fresh join token after revocation)
-- replaces the key and clears revoked_at; the audit log keeps the history.
CREATE TABLE identity.nodes (
    name text PRIMARY KEY,
    public_key text NOT NULL,
    enrolled_at timestamptz NOT NULL DEFAULT now(),
    -- The operator (token name) who created the join token used.
    enrolled_by text NOT NULL,
    revoked_at timestamptz
);

-- Join tokens: single use, expiring, stored as the SHA-256 of the token (hex);
-- the token itself is shown once, to the operator who created it.
CREATE TABLE identity.join_tokens (
    token_sha256 text PRIMARY KEY,
    node text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    expires_at timestamptz NOT NULL,
    used_at timestamptz
);

CREATE INDEX join_tokens_node ON identity.join_tokens (node);

-- Operators' API tokens (bearer, 256-bit random, stored as SHA-256 hex).
CREATE TABLE identity.tokens (
    id uuid PRIMARY KEY,
    name text NOT NULL,
    role text NOT NULL CHECK (role IN ('admin', 'operator', 'viewer')),
    token_sha256 text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    revoked_at timestamptz
);

-- The audit log: one row per operator action, appended from `*.operator.audit`
-- record events (event_id is the event's id, so a redelivery appends nothing).
-- Append-only: see V3.
CREATE TABLE identity.audit (
    seq bigserial PRIMARY KEY,
    event_id uuid NOT NULL UNIQUE,
    -- The context that served the request (the event's context).
    context text NOT NULL,
    principal_id uuid NOT NULL,
    principal text NOT NULL,
    role text NOT NULL,
    action text NOT NULL,
    target text NOT NULL,
    request_id uuid NOT NULL,
    at timestamptz NOT NULL,
    outcome text NOT NULL,
    status integer NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX audit_at ON identity.audit (at);
CREATE INDEX audit_principal ON identity.audit (principal, at);
CREATE INDEX audit_target ON identity.audit (target, at);
