-- The audit log is append-only, twice over:
-- 1. The identity role owns the schema, so it would hold every privilege on the
--    table; revoke UPDATE, DELETE and TRUNCATE from it (and from PUBLIC). At run
--    time the controller connects as this role and can only INSERT and SELECT.
-- 2. A trigger refuses UPDATE, DELETE and TRUNCATE whoever runs them.
-- Residual risk (docs/security.md): an owner may GRANT itself the privileges
-- back and drop the trigger; only a migration (reviewed code) would do that.
REVOKE UPDATE, DELETE, TRUNCATE ON identity.audit FROM PUBLIC;
REVOKE UPDATE, DELETE, TRUNCATE ON identity.audit FROM CURRENT_USER;

CREATE FUNCTION identity.audit_is_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'identity.audit is append-only: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER audit_no_update_delete
    BEFORE UPDATE OR DELETE ON identity.audit
    FOR EACH ROW EXECUTE FUNCTION identity.audit_is_append_only();

CREATE TRIGGER audit_no_truncate
    BEFORE TRUNCATE ON identity.audit
    FOR EACH STATEMENT EXECUTE FUNCTION identity.audit_is_append_only();
