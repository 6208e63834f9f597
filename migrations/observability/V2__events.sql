-- The record as the event stream serves it: every record event this context
-- subscribes to, in the order it was appended (`position`, the SSE id). Rows
-- older than the retention window are pruned; `horizon.through` is the newest
-- position pruned, so a client resuming from an older one is told to re-list.
CREATE TABLE observability.events (
    position bigserial PRIMARY KEY,
    event_id uuid NOT NULL UNIQUE,
    context text NOT NULL,
    event text NOT NULL,
    node text,
    module text,
    sent_at timestamptz NOT NULL,
    body jsonb NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX events_received_at ON observability.events (received_at);

CREATE TABLE observability.horizon (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    through bigint NOT NULL
);

INSERT INTO observability.horizon (through) VALUES (0);
