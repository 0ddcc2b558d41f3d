"""Database-side guards, so that not even raw SQL can change money that was invoiced:

- an invoice that is no longer a draft keeps every column except its state, the state's
  timestamps and the Stripe id; the state moves only draft -> finalized -> paid | void; a
  finalized invoice's total must equal the sum of its lines; only drafts may be deleted;
- lines of a non-draft invoice cannot be inserted, deleted or changed, except to record
  the Stripe item id once;
- audit entries are append-only.
"""

from django.db import migrations

GUARDS = r"""
CREATE OR REPLACE FUNCTION billing_invoice_guard() RETURNS trigger AS $$
DECLARE
    line_sum numeric;
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF OLD.status <> 'draft' THEN
            RAISE EXCEPTION 'invoice % is %, only drafts may be deleted', OLD.id, OLD.status
                USING ERRCODE = 'integrity_constraint_violation';
        END IF;
        RETURN OLD;
    END IF;
    IF OLD.status <> 'draft' THEN
        IF (to_jsonb(NEW) - ARRAY['status', 'paid_at', 'voided_at', 'payment_failed_at',
                                  'stripe_invoice_id'])
           IS DISTINCT FROM
           (to_jsonb(OLD) - ARRAY['status', 'paid_at', 'voided_at', 'payment_failed_at',
                                  'stripe_invoice_id']) THEN
            RAISE EXCEPTION 'invoice % is %: its amounts and period are immutable',
                OLD.id, OLD.status USING ERRCODE = 'integrity_constraint_violation';
        END IF;
    END IF;
    IF NEW.status IS DISTINCT FROM OLD.status AND NOT (
        (OLD.status = 'draft' AND NEW.status = 'finalized')
        OR (OLD.status = 'finalized' AND NEW.status IN ('paid', 'void'))
    ) THEN
        RAISE EXCEPTION 'invoice %: % -> % is not allowed', OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF OLD.status = 'draft' AND NEW.status = 'finalized' THEN
        SELECT COALESCE(SUM(amount), 0) INTO line_sum
            FROM billing_invoiceline WHERE invoice_id = NEW.id;
        IF line_sum <> NEW.total THEN
            RAISE EXCEPTION 'invoice %: total % is not the sum of its lines %',
                NEW.id, NEW.total, line_sum USING ERRCODE = 'integrity_constraint_violation';
        END IF;
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER billing_invoice_guard BEFORE UPDATE OR DELETE ON billing_invoice
    FOR EACH ROW EXECUTE FUNCTION billing_invoice_guard();

CREATE OR REPLACE FUNCTION billing_invoiceline_guard() RETURNS trigger AS $$
DECLARE
    inv_status text;
BEGIN
    SELECT status INTO inv_status FROM billing_invoice
        WHERE id = CASE WHEN TG_OP = 'DELETE' THEN OLD.invoice_id ELSE NEW.invoice_id END;
    IF TG_OP = 'UPDATE' AND OLD.invoice_id <> NEW.invoice_id THEN
        RAISE EXCEPTION 'invoice lines do not move between invoices'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    -- A missing invoice (cascade delete of a draft) or a draft: anything goes.
    IF inv_status IS NULL OR inv_status = 'draft' THEN
        RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.stripe_item_id = ''
       AND (to_jsonb(NEW) - 'stripe_item_id') = (to_jsonb(OLD) - 'stripe_item_id') THEN
        RETURN NEW;  -- recording the Stripe item id, once
    END IF;
    RAISE EXCEPTION 'invoice is %: its lines are immutable (% refused)', inv_status, TG_OP
        USING ERRCODE = 'integrity_constraint_violation';
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER billing_invoiceline_guard BEFORE INSERT OR UPDATE OR DELETE
    ON billing_invoiceline FOR EACH ROW EXECUTE FUNCTION billing_invoiceline_guard();

CREATE OR REPLACE FUNCTION billing_audit_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'billing audit entries are append-only (% refused)', TG_OP
        USING ERRCODE = 'integrity_constraint_violation';
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER billing_audit_append_only BEFORE UPDATE OR DELETE ON billing_auditentry
    FOR EACH ROW EXECUTE FUNCTION billing_audit_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS billing_audit_append_only ON billing_auditentry;
DROP TRIGGER IF EXISTS billing_invoiceline_guard ON billing_invoiceline;
DROP TRIGGER IF EXISTS billing_invoice_guard ON billing_invoice;
DROP FUNCTION IF EXISTS billing_audit_append_only();
DROP FUNCTION IF EXISTS billing_invoiceline_guard();
DROP FUNCTION IF EXISTS billing_invoice_guard();
"""


def create(apps, schema_editor):  # noqa: ANN001, ARG001 - migration signature
    if schema_editor.connection.vendor != "postgresql":
        raise RuntimeError("billing needs PostgreSQL (immutability triggers)")
    schema_editor.execute(GUARDS, params=None)  # no placeholders: RAISE uses %


def drop(apps, schema_editor):  # noqa: ANN001, ARG001
    schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("billing", "0001_initial")]

    operations = [migrations.RunPython(create, drop)]
