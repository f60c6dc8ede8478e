-- The outcome table: one row per (scope, key). Times are milliseconds since the Unix epoch,
-- read from the database's clock. `id` is never reused (AUTOINCREMENT), so (id, attempt)
-- fences a holder across a sweep and a new claim of the same key.
CREATE TABLE safe_retry_outcomes (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN ('in_progress', 'completed')),
    attempt          INTEGER NOT NULL,
    takeovers        INTEGER NOT NULL DEFAULT 0,
    locked_until     INTEGER,
    response_status  INTEGER,
    response_headers BLOB,
    response_body    BLOB,
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    UNIQUE (scope, key)
);
CREATE INDEX safe_retry_outcomes_expires_at ON safe_retry_outcomes (expires_at);
