-- A record's generation: the attempt at which it began (its first claim, or its renewal after its
-- retention). `attempt` keeps counting across renewals, so (id, attempt) still fences every
-- holder; a generation's starts are `attempt - generation + 1`, and the keys a record's steps and
-- messages send downstream are derived from (id, generation): the same for every attempt of one
-- generation, new when the key is renewed. `takeovers` was reset at each renewal, so the
-- generation of an existing row is `attempt - takeovers`.
ALTER TABLE safe_retry_outcomes ADD COLUMN generation INTEGER NOT NULL DEFAULT 1;
UPDATE safe_retry_outcomes SET generation = attempt - takeovers;
-- Nothing of a request is kept once its record has ended.
UPDATE safe_retry_outcomes SET request = NULL WHERE status <> 'in_progress';
UPDATE safe_retry_outcomes SET steps = NULL WHERE status = 'completed';
