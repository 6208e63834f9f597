-- Issue 29, point 1: what a node states about itself selects nothing by
-- default; operator labels do. So that no placement, file, setting, role or
-- grant moves on upgrade, every node's effective labels of before (its stated
-- labels overridden key by key by the operator's) become its operator labels
-- (their revision raised: an If-Match of before no longer holds). Keys under
-- the reserved `mesh.io/` are not carried over.
UPDATE inventory.nodes
SET operator_labels = COALESCE(
        (SELECT jsonb_object_agg(t.key, t.value) FROM jsonb_each(reported_labels) AS t
          WHERE t.key NOT LIKE 'mesh.io/%'),
        '{}'::jsonb) || operator_labels,
    labels_revision = labels_revision + 1
WHERE reported_labels <> '{}'::jsonb;

-- The labels bound to a node's join token, told by identity at its enrolment
-- (`identity.node.enrolled`): its operator labels from its first hello. The
-- newest enrolment wins.
CREATE TABLE inventory.enrolled_labels (
    node text PRIMARY KEY,
    labels jsonb NOT NULL,
    at timestamptz NOT NULL
);
