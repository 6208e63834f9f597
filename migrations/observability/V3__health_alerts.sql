-- Health and alerts (issue 13, parts 1 and 2). What observability learns,
-- each table from one source: the record (nodes, modules, conditions,
-- certificates), the nodes' reports (units, probes, outages), and what it
-- derives from them (replica and module health, alerts).

-- Nodes as the record tells them (inventory.node.*, identity.node.*).
CREATE TABLE observability.nodes (
    node text PRIMARY KEY,
    -- alive | unreachable
    state text NOT NULL DEFAULT 'alive',
    revoked boolean NOT NULL DEFAULT false,
    -- When the node was last heard before it was judged unreachable.
    unreachable_since timestamptz,
    -- The time of the newest liveness event applied (an older one arriving
    -- late changes nothing).
    updated_at timestamptz NOT NULL DEFAULT '-infinity'
);

-- Modules as inventory.module.placed / .removed tell them: the newest version
-- of each, and the nodes it has assignments on.
CREATE TABLE observability.modules (
    module text PRIMARY KEY,
    version bigint NOT NULL,
    nodes text[] NOT NULL DEFAULT '{}',
    removed boolean NOT NULL DEFAULT false
);

-- The newest fleet conditions inventory told (one row: the whole set).
CREATE TABLE observability.conditions (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    version bigint NOT NULL,
    conditions jsonb NOT NULL
);

-- Certificates the mesh CA issued (connectivity.certificate.issued).
CREATE TABLE observability.certificates (
    node text NOT NULL,
    name text NOT NULL,
    serial text NOT NULL,
    not_after timestamptz NOT NULL,
    -- When connectivity told the record it issued it (its lifetime is
    -- not_after - issued_at).
    issued_at timestamptz NOT NULL,
    PRIMARY KEY (node, name, serial)
);

-- Units as their nodes report them (the newest units report of each node).
CREATE TABLE observability.units (
    node text NOT NULL,
    unit text NOT NULL,
    module text NOT NULL,
    state text NOT NULL,
    restarts bigint NOT NULL,
    reported_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, unit)
);

-- Restarts as they grew between two units reports (a crash loop is restarts
-- growing within a window); pruned past the window. The first report of a
-- unit is its baseline: restarts from before it are not counted.
CREATE TABLE observability.unit_restarts (
    node text NOT NULL,
    unit text NOT NULL,
    grew bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX unit_restarts_at ON observability.unit_restarts (at);
CREATE INDEX unit_restarts_unit ON observability.unit_restarts (node, unit, at);

-- The newest report of each kind (health, units) of each node: its seq
-- orders them, so an older one arriving late changes nothing.
CREATE TABLE observability.report_seqs (
    node text NOT NULL,
    kind text NOT NULL,
    seq bigint NOT NULL,
    reported_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, kind)
);

-- Every probe's current result, as its node stated it last.
CREATE TABLE observability.probes (
    node text NOT NULL,
    unit text NOT NULL,
    probe text NOT NULL,
    module text NOT NULL,
    state text NOT NULL,
    since timestamptz NOT NULL,
    checked_at timestamptz,
    failures bigint NOT NULL DEFAULT 0,
    detail text,
    PRIMARY KEY (node, unit, probe)
);

-- Each change of a probe's state, kept for `probe_retention` (pruned).
CREATE TABLE observability.probe_history (
    id bigserial PRIMARY KEY,
    node text NOT NULL,
    unit text NOT NULL,
    probe text NOT NULL,
    module text NOT NULL,
    state text NOT NULL,
    detail text,
    at timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX probe_history_recorded_at ON observability.probe_history (recorded_at);

-- Broker outages nodes lived through (hello's outage), kept for
-- `outage_window` (pruned).
CREATE TABLE observability.outages (
    node text NOT NULL,
    since timestamptz NOT NULL,
    seconds bigint NOT NULL,
    buffered bigint NOT NULL,
    dropped bigint NOT NULL,
    reported_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, since)
);

CREATE INDEX outages_reported_at ON observability.outages (reported_at);

-- Health as the last evaluation derived it. `health` of a module and each
-- replica (`replicas`, JSON) is what observability.module.health told.
CREATE TABLE observability.module_health (
    module text PRIMARY KEY,
    health text NOT NULL,
    replicas jsonb NOT NULL,
    version bigint NOT NULL,
    since timestamptz NOT NULL DEFAULT now()
);

CREATE SEQUENCE observability.health_version;

-- Node behind on a section, first seen at (for the node_behind alert's bound).
CREATE TABLE observability.behind (
    node text NOT NULL,
    section text NOT NULL,
    declared bigint NOT NULL,
    applied bigint,
    since timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, section)
);

-- Alerts: open ones (resolved_at NULL) and resolved ones kept for
-- `alert_retention`. `key` is what the alert is about (at most one open
-- alert per key); `id` is the alert's identity for operators.
CREATE TABLE observability.alerts (
    id uuid PRIMARY KEY,
    key text NOT NULL,
    kind text NOT NULL,
    severity text NOT NULL,
    subject text NOT NULL,
    message text NOT NULL,
    since timestamptz NOT NULL,
    resolved_at timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE UNIQUE INDEX alerts_open_key ON observability.alerts (key) WHERE resolved_at IS NULL;
CREATE INDEX alerts_listing ON observability.alerts (since DESC, id DESC);
