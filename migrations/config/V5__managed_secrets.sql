-- Issue 16: secrets another context manages through the record (the
-- credentials of resource grants, `provisioning.credentials.*`): operators
-- read their metadata but never write, grant or delete them.
ALTER TABLE config.secrets ADD COLUMN managed_by text;
