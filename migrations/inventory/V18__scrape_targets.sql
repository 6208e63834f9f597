-- Issue 35: where Prometheus scrapes a node (`GET /v1/prometheus/targets`).
-- `scrape_host` is the address Prometheus reaches the node at: the agent's
-- metrics listener's own address when it names one, else the node's advertised
-- address (its overlay endpoint's); `metrics_port` the listener's port (none:
-- the agent serves no metrics). Both come from the node's newest hello.
ALTER TABLE inventory.nodes
    ADD COLUMN scrape_host text,
    ADD COLUMN metrics_port integer CHECK (metrics_port BETWEEN 1 AND 65535);
