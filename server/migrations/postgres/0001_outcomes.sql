-- The outcome table: one row per (scope, key). Times come from the database's clock, so the
-- servers of a fleet agree on every lease. `id` is never reused (a sequence), so (id, attempt)
-- fences a holder across a sweep and a new claim of the same key.
CREATE TABLE safe_retry_outcomes (
    id               BIGSERIAL   PRIMARY KEY,
    scope            TEXT        NOT NULL,
    key              TEXT        NOT NULL,
    fingerprint      BYTEA       NOT NULL,
    status           TEXT        NOT NULL CHECK (status IN ('in_progress', 'completed')),
    attempt          BIGINT      NOT NULL,
    takeovers        BIGINT      NOT NULL DEFAULT 0,
    locked_until     TIMESTAMPTZ,
    response_status  INTEGER,
    response_headers BYTEA,
    response_body    BYTEA,
    created_at       TIMESTAMPTZ NOT NULL,
    expires_at       TIMESTAMPTZ NOT NULL,
    UNIQUE (scope, key)
);
CREATE INDEX safe_retry_outcomes_expires_at ON safe_retry_outcomes (expires_at);
