-- The delivery context (issue 14, docs/decisions/0032): artifacts by digest,
-- immutable revisions, rollouts of one run per node, approvals, the freeze,
-- and the append-only receipt log of every run.

-- Artifacts pushed through the API: content-addressed, signed at push time.
CREATE TABLE delivery.artifacts (
    digest text PRIMARY KEY CHECK (digest ~ '^sha256:[0-9a-f]{64}$'),
    size bigint NOT NULL CHECK (size >= 0),
    signed_by text NOT NULL,
    pushed_by text NOT NULL,
    pushed_at timestamptz NOT NULL DEFAULT now()
);

-- A module's runnable definition. Immutable: a change is a new revision
-- (the trigger below refuses UPDATE and DELETE).
CREATE TABLE delivery.revisions (
    id uuid PRIMARY KEY,
    module text NOT NULL,
    -- sha256 hex of the canonical definition (artifact, unit, settings digest).
    digest text NOT NULL,
    artifact text CHECK (artifact IS NULL OR artifact ~ '^sha256:[0-9a-f]{64}$'),
    unit jsonb NOT NULL,
    settings_digest text,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    UNIQUE (module, digest)
);
CREATE INDEX revisions_module ON delivery.revisions (module, created_at);

-- Where modules run, from inventory.module.placed / .removed (newest version wins).
CREATE TABLE delivery.modules (
    module text PRIMARY KEY,
    nodes text[] NOT NULL,
    version bigint NOT NULL
);

-- Per module: whether its rollouts wait for an operator's approval.
CREATE TABLE delivery.policies (
    module text PRIMARY KEY,
    require_approval boolean NOT NULL DEFAULT false
);

-- The freeze: at most one row.
CREATE TABLE delivery.freeze (
    id smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    reason text NOT NULL,
    pause_in_flight boolean NOT NULL,
    since timestamptz NOT NULL,
    frozen_by text NOT NULL
);

CREATE TABLE delivery.rollouts (
    id uuid PRIMARY KEY,
    module text NOT NULL,
    revision uuid NOT NULL REFERENCES delivery.revisions (id),
    previous_revision uuid REFERENCES delivery.revisions (id),
    state text NOT NULL CHECK (state IN ('awaiting_approval', 'running', 'paused',
        'succeeded', 'failed', 'rolled_back', 'denied', 'canceled')),
    paused_reason text,
    reason text,
    max_unavailable integer NOT NULL CHECK (max_unavailable >= 1),
    max_extra integer NOT NULL CHECK (max_extra >= 0),
    settle_secs integer NOT NULL CHECK (settle_secs >= 0),
    deadline_secs integer NOT NULL CHECK (deadline_secs >= 1),
    failure_threshold integer NOT NULL CHECK (failure_threshold >= 1),
    auto_rollback boolean NOT NULL,
    canary integer NOT NULL CHECK (canary >= 0),
    canary_passed boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL
);
-- One rollout in progress per module.
CREATE UNIQUE INDEX rollouts_one_active ON delivery.rollouts (module)
    WHERE state IN ('awaiting_approval', 'running', 'paused');

-- One run per target node of a rollout.
CREATE TABLE delivery.runs (
    id uuid PRIMARY KEY,
    rollout uuid NOT NULL REFERENCES delivery.rollouts (id),
    node text NOT NULL,
    position integer NOT NULL,
    revision uuid NOT NULL REFERENCES delivery.revisions (id),
    previous_revision uuid REFERENCES delivery.revisions (id),
    state text NOT NULL CHECK (state IN ('queued', 'awaiting_approval', 'staging', 'deploying',
        'settling', 'succeeded', 'failed', 'canceled', 'rolled_back')),
    reason text,
    -- The delivery section's generation that carried the artifact.
    staged_generation bigint,
    deployed_at timestamptz,
    healthy_since timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (rollout, node),
    UNIQUE (rollout, position)
);

-- The receipt log: append-only (see below), one sequence per run.
CREATE TABLE delivery.receipts (
    id uuid PRIMARY KEY,
    run uuid NOT NULL REFERENCES delivery.runs (id),
    seq integer NOT NULL CHECK (seq >= 1),
    kind text NOT NULL CHECK (kind ~ '^[a-z][a-z_]*(\.[a-z][a-z_]*)+$'),
    at timestamptz NOT NULL,
    detail jsonb NOT NULL DEFAULT '{}',
    UNIQUE (run, seq)
);

-- The revision each node's replicas of a module run (what delivery told
-- inventory in delivery.module.targets), and each module's event version.
CREATE TABLE delivery.targets (
    module text NOT NULL,
    node text NOT NULL,
    revision uuid NOT NULL REFERENCES delivery.revisions (id),
    PRIMARY KEY (module, node)
);
CREATE TABLE delivery.target_versions (
    module text PRIMARY KEY,
    version bigint NOT NULL
);

-- What nodes state: their units (from units reports, newest seq wins) and the
-- outcome of their delivery section's artifacts (from applied reports).
CREATE TABLE delivery.units (
    node text NOT NULL,
    unit text NOT NULL,
    module text NOT NULL,
    state text NOT NULL,
    revision uuid,
    restarts integer NOT NULL,
    started_at timestamptz,
    PRIMARY KEY (node, unit)
);
CREATE TABLE delivery.unit_reports (
    node text PRIMARY KEY,
    seq bigint NOT NULL
);
CREATE TABLE delivery.artifact_outcomes (
    node text NOT NULL,
    digest text NOT NULL,
    generation bigint NOT NULL,
    ok boolean NOT NULL,
    error text,
    PRIMARY KEY (node, digest)
);
-- Replica health from observability.module.health (newest version per module).
CREATE TABLE delivery.health (
    module text NOT NULL,
    node text NOT NULL,
    health text NOT NULL,
    reason text,
    version bigint NOT NULL,
    PRIMARY KEY (module, node)
);

-- Receipts are append-only, twice over (as identity.audit): the delivery role
-- loses UPDATE, DELETE and TRUNCATE on them, and a trigger refuses those
-- whoever runs them. Revisions lose DELETE and TRUNCATE and a trigger refuses
-- UPDATE too (the role keeps the UPDATE privilege only because foreign keys
-- to revisions lock the referenced row FOR KEY SHARE, which needs it).
REVOKE UPDATE, DELETE, TRUNCATE ON delivery.receipts FROM PUBLIC;
REVOKE UPDATE, DELETE, TRUNCATE ON delivery.receipts FROM CURRENT_USER;
REVOKE DELETE, TRUNCATE ON delivery.revisions FROM PUBLIC;
REVOKE DELETE, TRUNCATE ON delivery.revisions FROM CURRENT_USER;

CREATE FUNCTION delivery.append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%.% is append-only: % refused', TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER receipts_no_update_delete BEFORE UPDATE OR DELETE ON delivery.receipts
    FOR EACH ROW EXECUTE FUNCTION delivery.append_only();
CREATE TRIGGER receipts_no_truncate BEFORE TRUNCATE ON delivery.receipts
    FOR EACH STATEMENT EXECUTE FUNCTION delivery.append_only();
CREATE TRIGGER revisions_no_update_delete BEFORE UPDATE OR DELETE ON delivery.revisions
    FOR EACH ROW EXECUTE FUNCTION delivery.append_only();
CREATE TRIGGER revisions_no_truncate BEFORE TRUNCATE ON delivery.revisions
    FOR EACH STATEMENT EXECUTE FUNCTION delivery.append_only();

-- An append must carry the next sequence number and a time not before the
-- previous receipt's (the context checks it too, before it writes).
CREATE FUNCTION delivery.receipt_in_order() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    last_seq integer;
    last_at timestamptz;
BEGIN
    SELECT seq, at INTO last_seq, last_at FROM delivery.receipts
        WHERE run = NEW.run ORDER BY seq DESC LIMIT 1;
    IF NEW.seq <> COALESCE(last_seq, 0) + 1 THEN
        RAISE EXCEPTION 'receipt of run %: seq % is not the next (%)', NEW.run, NEW.seq,
            COALESCE(last_seq, 0) + 1 USING ERRCODE = 'check_violation';
    END IF;
    IF last_at IS NOT NULL AND NEW.at < last_at THEN
        RAISE EXCEPTION 'receipt of run %: time % is before the previous (%)', NEW.run, NEW.at,
            last_at USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER receipts_in_order BEFORE INSERT ON delivery.receipts
    FOR EACH ROW EXECUTE FUNCTION delivery.receipt_in_order();
