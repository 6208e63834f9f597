-- What config knows of nodes: only what inventory.node.* events told it.
CREATE TABLE config.nodes (
    node text PRIMARY KEY,
    labels jsonb NOT NULL DEFAULT '{}',
    -- inventory's version of the node; an event with version <= this is ignored.
    version bigint NOT NULL
);

-- Files operators declare, for one node or for every node a selector matches.
CREATE TABLE config.files (
    name text PRIMARY KEY CHECK (name ~ '^[a-z0-9._-]{1,63}$'),
    path text NOT NULL,
    content text NOT NULL,
    mode integer NOT NULL CHECK (mode BETWEEN 0 AND 4095),
    node text,
    -- Label map; matches a node whose labels contain every pair ({} matches all).
    selector jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((node IS NULL) <> (selector IS NULL))
);

CREATE INDEX files_node ON config.files (node) WHERE node IS NOT NULL;

-- The config section declared to each node, and what the node reported of it.
CREATE TABLE config.sections (
    node text PRIMARY KEY,
    generation bigint NOT NULL,
    digest text NOT NULL,
    items jsonb NOT NULL,
    declared_at timestamptz NOT NULL DEFAULT now(),
    last_sent_at timestamptz NOT NULL DEFAULT now(),
    applied_generation bigint NOT NULL DEFAULT 0,
    applied_outcome text,
    applied_outcome_generation bigint,
    applied_error text,
    applied_at timestamptz
);
