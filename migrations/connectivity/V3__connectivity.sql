-- Issue 12: the connectivity context's own tables (decision 0027).

-- Every node connectivity knows of: from its hellos (the WireGuard public key
-- and endpoint it states; the node is the broker-verified sender) and from the
-- record (labels from inventory.node.*, revocation from identity.node.*). A
-- revoked node's row stays, so a late hello or event never brings it back.
CREATE TABLE connectivity.nodes (
    node text PRIMARY KEY,
    -- WireGuard public key (base64) and endpoint (ip:port) of its latest hello.
    public_key text,
    endpoint text,
    -- When the key was last stated (the controller's clock).
    key_at timestamptz,
    labels jsonb NOT NULL DEFAULT '{}',
    -- The version of the newest inventory.node.* event applied (0: none yet).
    labels_version bigint NOT NULL DEFAULT 0,
    -- The `at` of the newest identity.node.* event applied.
    identity_at timestamptz,
    revoked_at timestamptz,
    first_seen timestamptz NOT NULL DEFAULT now()
);

-- Each node's overlay address, an IPv4 address as an integer (0 to 2^32-1),
-- unique by constraint: two allocations can never hand out one address. Kept
-- across restarts (it is here), deleted when the node is revoked (freed).
CREATE TABLE connectivity.addresses (
    node text PRIMARY KEY REFERENCES connectivity.nodes (node),
    address bigint NOT NULL UNIQUE CHECK (address BETWEEN 0 AND 4294967295),
    allocated_at timestamptz NOT NULL DEFAULT now()
);

-- Where each module runs and its ports, as inventory.module.placed /
-- .removed last said (the newest version wins).
CREATE TABLE connectivity.modules (
    module text PRIMARY KEY,
    version bigint NOT NULL,
    removed boolean NOT NULL DEFAULT false,
    nodes text[] NOT NULL,
    ports jsonb NOT NULL DEFAULT '[]'
);

-- The latest certificate request of each node for each name and what became
-- of it: signed (serial), refused (reason) or waiting (no CA configured; the
-- CSR is kept so it is signed once a CA is there).
CREATE TABLE connectivity.requests (
    node text NOT NULL,
    name text NOT NULL,
    csr text NOT NULL,
    csr_digest text NOT NULL,
    status text NOT NULL CHECK (status IN ('signed', 'refused', 'waiting')),
    reason text,
    serial text,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, name)
);

-- Every certificate the mesh CA issued.
CREATE TABLE connectivity.certificates (
    serial text PRIMARY KEY,
    node text NOT NULL,
    name text NOT NULL,
    subject text NOT NULL,
    csr_digest text NOT NULL,
    certificate text NOT NULL,
    not_after timestamptz NOT NULL,
    issued_at timestamptz NOT NULL DEFAULT now(),
    -- Set when the node was revoked.
    revoked_at timestamptz
);

CREATE INDEX certificates_newest ON connectivity.certificates (node, name, issued_at DESC);

-- What each node says it holds (the `held` part of its certificates reports).
CREATE TABLE connectivity.held (
    node text NOT NULL,
    name text NOT NULL,
    serial text NOT NULL,
    not_after timestamptz NOT NULL,
    renew_error text,
    reported_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node, name)
);
