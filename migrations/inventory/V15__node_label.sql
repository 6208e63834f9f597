-- Issue 29, point 1: every node's effective labels hold the read-only
-- `mesh.io/node=<id>` (its id as the broker proved it), so a selector can name
-- one node. The other contexts keep copies of effective labels from the
-- record: every node is flagged to be told again (`inventory.node.updated`,
-- version raised), and the sweep announces the flagged in batches. Any later
-- change to what effective labels hold sets the flag the same way.
ALTER TABLE inventory.nodes ADD COLUMN announce boolean NOT NULL DEFAULT false;
UPDATE inventory.nodes SET announce = true;
CREATE INDEX nodes_announce ON inventory.nodes (id) WHERE announce;
