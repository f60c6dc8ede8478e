-- A record's identity: what the keys its steps and messages send downstream derive from. Random,
-- drawn by the claim that creates the record or renews it after its retention, and kept through
-- every attempt, takeover and resumption: two databases (or one rebuilt) never give two records
-- one identity, where row ids start again from 1 in each. A record made before this migration
-- keeps the identity its keys were derived from: its row id and generation.
ALTER TABLE safe_retry_outcomes ADD COLUMN identity TEXT;
UPDATE safe_retry_outcomes SET identity = id::TEXT || '.' || generation::TEXT;
ALTER TABLE safe_retry_outcomes
    ALTER COLUMN identity SET DEFAULT replace(gen_random_uuid()::TEXT, '-', ''),
    ALTER COLUMN identity SET NOT NULL;
