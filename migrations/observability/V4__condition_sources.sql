-- Conditions come from more than one context now (inventory's fleet
-- conditions, provisioning's grant conditions): one row per source, each the
-- whole set that source last told.
ALTER TABLE observability.conditions ADD COLUMN source text NOT NULL DEFAULT 'inventory';
-- Drops the one-row primary key and its check with it.
ALTER TABLE observability.conditions DROP COLUMN one;
ALTER TABLE observability.conditions ALTER COLUMN source DROP DEFAULT;
ALTER TABLE observability.conditions ADD PRIMARY KEY (source);
