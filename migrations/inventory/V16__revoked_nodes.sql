-- Issue 39 (decision 0050): identity's newest word on every node it revoked
-- or re-admitted, whether inventory has heard the node's hello or not, so the
-- controller refuses a revoked node's reports from its first one, across
-- restarts (the set is loaded into memory at start and kept current from
-- the record: no database read per report).
CREATE TABLE inventory.revocations (
    node text PRIMARY KEY,
    revoked boolean NOT NULL,
    -- The event's `at`: an older event arriving late changes nothing.
    at timestamptz NOT NULL
);

INSERT INTO inventory.revocations (node, revoked, at)
    SELECT id, true, COALESCE(identity_at, now()) FROM inventory.nodes
    WHERE admin_state = 'revoked';
