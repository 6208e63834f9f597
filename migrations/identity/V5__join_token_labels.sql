-- Issue 29, point 1: the labels an operator binds to a join token
-- (`meshctl node add --label`), handed to inventory at enrolment as the
-- node's operator labels: a new node is selected by what its operator chose,
-- not by what it says of itself.
ALTER TABLE identity.join_tokens ADD COLUMN labels jsonb NOT NULL DEFAULT '{}';
