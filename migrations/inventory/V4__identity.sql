-- What identity told inventory on the record: when the node's identity last
-- changed (enrolled or revoked), so an older event arriving late changes nothing.
ALTER TABLE inventory.nodes ADD COLUMN identity_at timestamptz;
