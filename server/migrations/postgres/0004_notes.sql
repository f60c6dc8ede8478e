-- Why an operator abandoned a record, kept with it until its retention ends.
ALTER TABLE safe_retry_outcomes ADD COLUMN note TEXT;
