-- Nodes as they state themselves (hello facts, reported labels) and as operators
-- label them. Effective labels = reported labels overridden key by key by
-- operator labels; `version` grows whenever the effective labels change and is
-- carried in inventory.node.* events so receivers can ignore stale ones.
CREATE TABLE inventory.nodes (
    id text PRIMARY KEY,
    hostname text NOT NULL,
    arch text NOT NULL,
    cpus bigint NOT NULL,
    memory_bytes bigint NOT NULL,
    agent_version text NOT NULL,
    public_key text,
    reported_labels jsonb NOT NULL DEFAULT '{}',
    operator_labels jsonb NOT NULL DEFAULT '{}',
    first_seen timestamptz NOT NULL DEFAULT now(),
    last_seen timestamptz NOT NULL DEFAULT now(),
    -- sent_at of the hello the facts come from; an older hello never overwrites.
    hello_at timestamptz NOT NULL DEFAULT now(),
    last_seq bigint NOT NULL DEFAULT 0,
    state text NOT NULL DEFAULT 'alive',
    version bigint NOT NULL DEFAULT 1
);

-- What each node has applied, per section (from hello, heartbeat and applied).
CREATE TABLE inventory.applied (
    node text NOT NULL REFERENCES inventory.nodes (id) ON DELETE CASCADE,
    section text NOT NULL,
    -- Newest generation the node applied successfully (0: none known).
    generation bigint NOT NULL DEFAULT 0,
    -- Last reported outcome (applied | failed | rejected), its generation and error.
    outcome text,
    outcome_generation bigint,
    error text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, section)
);
