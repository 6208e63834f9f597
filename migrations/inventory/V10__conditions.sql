-- Alerts move to one owner, observability. Inventory keeps no alerts any more:
-- the conditions its fleet reconcile finds (placement_unsatisfied,
-- pinned_unreachable, replacement_paused) are facts it tells the record, the
-- whole set in one `inventory.fleet.conditions` event whenever the set changes.

-- `inventory.alerts` held what the last pass found, never told to anyone but
-- `GET /v1/alerts` (gone). It is dropped, not renamed: `inventory.conditions`
-- holds what inventory last told the record, and it has told nothing yet, so
-- it starts empty and the first pass tells whatever holds then.
DROP TABLE inventory.alerts;

-- The version of every `inventory.fleet.conditions` event: it only grows.
CREATE SEQUENCE inventory.conditions_version;

-- What the fleet reconcile last told the record: one row per condition of the
-- last `inventory.fleet.conditions` event (`version`). A pass whose set
-- differs writes a new event and replaces every row.
CREATE TABLE inventory.conditions (
    key text PRIMARY KEY,
    kind text NOT NULL,
    node text,
    module text,
    stateful boolean NOT NULL DEFAULT false,
    message text NOT NULL,
    version bigint NOT NULL,
    told_at timestamptz NOT NULL DEFAULT now()
);
