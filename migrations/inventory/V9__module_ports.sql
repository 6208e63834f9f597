-- Issue 12: a module's ports (who may reach each over the overlay, which are
-- exposed publicly) live in its spec (`inventory.modules.spec`, jsonb) and are
-- told to the record with its placement: what was last told is kept here, so a
-- change of ports alone publishes a new `inventory.module.placed`.
ALTER TABLE inventory.module_placements ADD COLUMN ports jsonb NOT NULL DEFAULT '[]';
