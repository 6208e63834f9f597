-- Fleet lifecycle: liveness, administrative state, modules and their intent
-- layers, assignments (which replica runs where), the inventory section declared
-- to each node, and alerts.

-- `state` is liveness as the controller judges it (alive | unreachable);
-- `admin_state` is what operators decided (active | draining | drained | revoked).
-- `heard_at` is the controller's clock when it last handled a report of the node:
-- liveness is judged on it, never on the node's own clock.
ALTER TABLE inventory.nodes
    ADD COLUMN heard_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN unreachable_since timestamptz,
    ADD COLUMN admin_state text NOT NULL DEFAULT 'active'
        CHECK (admin_state IN ('active', 'draining', 'drained', 'revoked')),
    -- Why a drain cannot finish yet (none: not draining, or nothing blocks it).
    ADD COLUMN drain_blocked text,
    -- seq of the newest units report handled; an older one changes nothing.
    ADD COLUMN units_seq bigint NOT NULL DEFAULT 0,
    ADD CONSTRAINT nodes_state CHECK (state IN ('alive', 'unreachable'));

-- A module: a unit spec, stateful flag, desired state and one placement (jsonb,
-- validated by the API). `revision` is the ETag; every write bumps it.
CREATE TABLE inventory.modules (
    name text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9-]{0,47}$'),
    spec jsonb NOT NULL,
    revision bigint NOT NULL DEFAULT 1,
    -- Why the last reconcile could not place it (none: placed as asked).
    placement_error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Intent layers, each with its own writer: policy {min, max}, autoscaler {replicas}.
-- The user layer is the module's own `replicas`.
CREATE TABLE inventory.intents (
    module text NOT NULL REFERENCES inventory.modules (name) ON DELETE CASCADE,
    layer text NOT NULL CHECK (layer IN ('policy', 'autoscaler')),
    value jsonb NOT NULL,
    revision bigint NOT NULL DEFAULT 1,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (module, layer)
);

-- Which replica of which module a node runs, under which unit name.
-- `role` active: part of the replica set; retiring: replaced (make-before-break),
-- kept running until its replacement runs. No foreign key to modules: the rows of
-- a deleted module are removed by the reconcile, which re-declares the node.
CREATE TABLE inventory.assignments (
    node text NOT NULL REFERENCES inventory.nodes (id) ON DELETE CASCADE,
    name text NOT NULL,
    module text NOT NULL,
    replica integer NOT NULL CHECK (replica >= 0),
    role text NOT NULL CHECK (role IN ('active', 'retiring')),
    placed_at timestamptz NOT NULL,
    -- What the node last reported of the unit (units report).
    unit_state text,
    pid bigint,
    exit_code integer,
    restarts bigint NOT NULL DEFAULT 0,
    started_at timestamptz,
    reported_at timestamptz,
    PRIMARY KEY (node, name)
);

CREATE INDEX assignments_module ON inventory.assignments (module, replica);

-- The inventory section declared to each node (its units), like config.sections.
CREATE TABLE inventory.sections (
    node text PRIMARY KEY REFERENCES inventory.nodes (id) ON DELETE CASCADE,
    generation bigint NOT NULL,
    digest text NOT NULL,
    items jsonb NOT NULL,
    declared_at timestamptz NOT NULL DEFAULT now(),
    last_sent_at timestamptz NOT NULL DEFAULT now()
);

-- Open alerts, one per key; the reconcile raises and clears them.
CREATE TABLE inventory.alerts (
    key text PRIMARY KEY,
    kind text NOT NULL,
    node text,
    module text,
    message text NOT NULL,
    raised_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
