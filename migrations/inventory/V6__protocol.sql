-- Version skew (decision 0020): the envelope versions each node's agent speaks,
-- from its hello (absent in an older agent's hello: 1..1), and why the
-- controller refused it (no common version), or NULL. A refused node is never
-- scheduled and nothing is declared to it until a hello it can speak arrives.
ALTER TABLE inventory.nodes
    ADD COLUMN protocol_min integer NOT NULL DEFAULT 1,
    ADD COLUMN protocol_max integer NOT NULL DEFAULT 1,
    ADD COLUMN refused text;
