-- Issue 35: alerts delivered to Alertmanager. Every change of an alert (it
-- opened, its message or severity changed, it resolved) marks it pending in
-- the same transaction, by trigger, so no path that writes an alert can
-- forget to: this table is the context's outbox for Alertmanager. The
-- delivery task posts each pending alert as it is now (open, or resolved with
-- its `endsAt`) to every `alertmanager_urls` and removes the mark only when
-- all accepted it and no newer change came meanwhile (`changed_at`). An
-- Alertmanager that is down loses nothing: the marks wait; an alert opened
-- and resolved meanwhile is delivered once, resolved. Bounded by the alerts
-- themselves (one mark per alert; a pruned alert takes its mark with it).
CREATE TABLE observability.alertmanager_pending (
    alert uuid PRIMARY KEY REFERENCES observability.alerts (id) ON DELETE CASCADE,
    changed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE FUNCTION observability.alert_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO observability.alertmanager_pending (alert, changed_at)
    VALUES (NEW.id, clock_timestamp())
    ON CONFLICT (alert) DO UPDATE SET changed_at = EXCLUDED.changed_at;
    RETURN NULL;
END;
$$;

CREATE TRIGGER alert_pending AFTER INSERT OR UPDATE ON observability.alerts
    FOR EACH ROW EXECUTE FUNCTION observability.alert_pending();
