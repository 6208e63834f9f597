-- Which revision each node's replicas of a module run, as delivery tells the
-- record (`delivery.module.targets`): the newest event's revisions and
-- targets, whole. A node the targets name runs its revision's unit; every
-- other replica runs the module's own spec. Dropped with the module.
CREATE TABLE inventory.module_targets (
    module text PRIMARY KEY,
    version bigint NOT NULL,
    revisions jsonb NOT NULL,
    targets jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
