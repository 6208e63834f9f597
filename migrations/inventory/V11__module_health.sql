-- Each module's health as observability tells the record
-- (`observability.module.health`): the newest event's health and replicas,
-- shown in the module view. Inventory never derives health itself.
CREATE TABLE inventory.module_health (
    module text PRIMARY KEY,
    version bigint NOT NULL,
    health text NOT NULL,
    replicas jsonb NOT NULL,
    at timestamptz NOT NULL
);
