-- Issue 16: what a module requires and provides (resource grants) is told
-- with its placement, so a change of either alone publishes a new
-- `inventory.module.placed`.
ALTER TABLE inventory.module_placements ADD COLUMN requires jsonb NOT NULL DEFAULT '[]';
ALTER TABLE inventory.module_placements ADD COLUMN provides jsonb NOT NULL DEFAULT '[]';
