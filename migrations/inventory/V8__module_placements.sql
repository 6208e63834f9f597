-- Issue 11: where modules run, told to the record; labels with ETags.

-- The version of every `inventory.module.*` event: one sequence for all
-- modules, so a module's versions grow across delete and re-create.
CREATE SEQUENCE inventory.module_event_version;

-- What the fleet reconcile last told the record of each module
-- (`inventory.module.placed`): the nodes it has assignments on (a sorted JSON
-- array of node ids) and its settings files. A module whose desired placement
-- differs from its row gets a new event and the row; a row whose module is gone
-- gets `inventory.module.removed` and is dropped.
CREATE TABLE inventory.module_placements (
    module text PRIMARY KEY,
    nodes jsonb NOT NULL,
    settings_files jsonb NOT NULL,
    version bigint NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now()
);

-- The ETag of a node's operator labels: raised by every labels write.
ALTER TABLE inventory.nodes ADD COLUMN labels_revision bigint NOT NULL DEFAULT 1;
