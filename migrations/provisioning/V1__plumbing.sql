-- Plumbing every context has: the inbox (ids of handled messages, so a
-- redelivery has no second effect) and the transactional outbox (declarations and
-- record events written in the transaction that caused them; the controller's
-- relay publishes them with confirms and then sets sent_at).
CREATE TABLE provisioning.inbox (
    message_id uuid PRIMARY KEY,
    received_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX inbox_received_at ON provisioning.inbox (received_at);

CREATE TABLE provisioning.outbox (
    id bigserial PRIMARY KEY,
    message_id uuid NOT NULL UNIQUE,
    exchange text NOT NULL,
    routing_key text NOT NULL,
    kind text NOT NULL,
    node text,
    payload bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at timestamptz
);

CREATE INDEX outbox_unsent ON provisioning.outbox (id) WHERE sent_at IS NULL;
