-- Optimistic concurrency on files (ETag "<revision>").
ALTER TABLE config.files ADD COLUMN revision bigint NOT NULL DEFAULT 1;

-- Settings layers: one row per scope (global; a named label selector; a node;
-- a module), each a map of key -> JSON scalar, written whole.
CREATE TABLE config.settings (
    scope text NOT NULL CHECK (scope IN ('global', 'labels', 'node', 'module')),
    -- '' for global; the layer's name for labels; the node id; the module name.
    name text NOT NULL,
    -- labels scope only: the pairs a node's labels must contain.
    selector jsonb,
    "values" jsonb NOT NULL,
    revision bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, name),
    CHECK ((scope = 'labels') = (selector IS NOT NULL)),
    CHECK (scope <> 'global' OR name = '')
);

-- Secrets: the data key of each (AES-256-GCM) wrapped under a master key.
CREATE TABLE config.secrets (
    name text PRIMARY KEY CHECK (name ~ '^[a-z0-9._-]{1,63}$'),
    -- The newest version; the ETag.
    version bigint NOT NULL,
    -- The master key (id in the keyring file) the data key is wrapped under.
    key_id text NOT NULL,
    -- nonce (12 bytes) || AES-256-GCM of the 32-byte data key under the master key.
    wrapped_key bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Every version of each secret, encrypted under the secret's data key.
CREATE TABLE config.secret_versions (
    secret text NOT NULL REFERENCES config.secrets (name) ON DELETE CASCADE,
    version bigint NOT NULL,
    -- nonce (12 bytes) || AES-256-GCM ciphertext; the AAD binds name and version.
    ciphertext bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    PRIMARY KEY (secret, version)
);

-- A module may receive a secret only through a grant.
CREATE TABLE config.grants (
    module text NOT NULL,
    secret text NOT NULL REFERENCES config.secrets (name) ON DELETE CASCADE,
    -- The file's name under /modules/<module>/secrets/ on the node.
    file text NOT NULL,
    revision bigint NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    PRIMARY KEY (module, secret)
);

CREATE INDEX grants_secret ON config.grants (secret);
-- Two grants of one module never share a file.
CREATE UNIQUE INDEX grants_file ON config.grants (module, file);

-- Where modules run, as inventory.module.* events tell it (never read from
-- inventory's tables). A removed module keeps its row (removed = true) so an
-- older event cannot bring it back.
CREATE TABLE config.modules (
    module text PRIMARY KEY,
    version bigint NOT NULL,
    removed boolean NOT NULL DEFAULT false,
    nodes text[] NOT NULL DEFAULT '{}',
    settings_files jsonb NOT NULL DEFAULT '[]'
);

-- Each node's key-agreement public key (X25519, hex), from its hellos: what
-- secrets are sealed to.
CREATE TABLE config.node_keys (
    node text PRIMARY KEY,
    seal_key text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The sealed form of each secret file declared to a node, kept so that a
-- node's section (and its digest) changes only when the secret's version, the
-- node's key or the path does: sealing is randomized. Ciphertext only.
CREATE TABLE config.sealed (
    node text NOT NULL,
    path text NOT NULL,
    secret text NOT NULL,
    version bigint NOT NULL,
    seal_key text NOT NULL,
    sealed text NOT NULL,
    PRIMARY KEY (node, path)
);
