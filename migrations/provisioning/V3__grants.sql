-- The provisioning context's own copy of what the record told of each module
-- (inventory.module.placed / .removed): where it runs, what it requires and
-- what it provides. Newest event by version wins; never inventory's tables.
CREATE TABLE provisioning.modules (
    module text PRIMARY KEY,
    version bigint NOT NULL,
    removed boolean NOT NULL DEFAULT false,
    nodes text[] NOT NULL DEFAULT '{}',
    requires jsonb NOT NULL DEFAULT '[]',
    provides jsonb NOT NULL DEFAULT '[]'
);

-- A grant: one requirement of one consumer module, served by one provider
-- module. The credential's user and version are kept; its password never is
-- (it leaves only sealed, on the record, for config).
CREATE TABLE provisioning.grants (
    id uuid PRIMARY KEY,
    consumer text NOT NULL,
    requirement text NOT NULL,
    kind text NOT NULL,
    options jsonb NOT NULL DEFAULT '{}',
    delete_on_revoke boolean NOT NULL DEFAULT false,
    -- The provider module (none while no provider can serve it) and what it
    -- provides for the kind, as last known (kept for a revoked grant).
    provider text,
    provides jsonb,
    -- The name on the provider's server: <consumer>-<requirement>.
    resource text NOT NULL,
    login text,
    credential_version bigint NOT NULL DEFAULT 0 CHECK (credential_version >= 0),
    -- What the provider's nodes are told to make of it.
    declared text NOT NULL DEFAULT 'present' CHECK (declared IN ('present', 'revoked', 'deleted')),
    -- What the API says of it, recomputed by every pass.
    state text NOT NULL DEFAULT 'requested'
        CHECK (state IN ('requested', 'provisioning', 'ready', 'failed', 'revoked')),
    reason text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    retain_until timestamptz
);

-- At most one live grant per requirement of a consumer.
CREATE UNIQUE INDEX grants_live ON provisioning.grants (consumer, requirement)
    WHERE revoked_at IS NULL;
-- The API's order.
CREATE INDEX grants_order ON provisioning.grants (consumer, requirement, id);

-- What each provider node's agent last reported of a grant's resource (its
-- whole `resources` report replaces its rows).
CREATE TABLE provisioning.statuses (
    grant_id uuid NOT NULL REFERENCES provisioning.grants (id) ON DELETE CASCADE,
    node text NOT NULL,
    state text NOT NULL CHECK (state IN ('ready', 'waiting', 'failed', 'revoked', 'deleted')),
    credential_version bigint,
    reason text,
    recreated boolean NOT NULL DEFAULT false,
    reported_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (grant_id, node)
);

CREATE INDEX statuses_node ON provisioning.statuses (node);

-- The grant conditions last told to the record (provisioning.grants.conditions),
-- one row; the version grows with every set told.
CREATE TABLE provisioning.conditions (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version bigint NOT NULL,
    conditions jsonb NOT NULL
);

CREATE SEQUENCE provisioning.conditions_version;
