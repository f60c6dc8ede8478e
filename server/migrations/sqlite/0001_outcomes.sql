-- The outcome table: one row per (scope, key). `step` names the last recovery point reached
-- (`name:started` before an external call, `name:done` after its step committed), `steps` holds
-- the committed steps' outputs (a JSON object by step name), `request` the request a resumption
-- runs again (saved with the first recovery point). Times are milliseconds since the Unix epoch,
-- read from the database's clock. `id` is never reused (AUTOINCREMENT), so (id, attempt)
-- fences a holder across a sweep and a new claim of the same key.
CREATE TABLE safe_retry_outcomes (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    -- Spelt with OR, not IN: SQLite checks an IN list of three or more values through a
    -- temporary b-tree built for each statement that writes the row (two per claim).
    status           TEXT    NOT NULL
                     CHECK (status = 'in_progress' OR status = 'completed' OR status = 'failed'),
    attempt          INTEGER NOT NULL,
    takeovers        INTEGER NOT NULL DEFAULT 0,
    locked_until     INTEGER,
    response_status  INTEGER,
    response_headers BLOB,
    response_body    BLOB,
    step             TEXT,
    steps            TEXT,
    request          BLOB,
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    UNIQUE (scope, key)
);
CREATE INDEX safe_retry_outcomes_expires_at ON safe_retry_outcomes (expires_at);
-- The reconciler's search: resumable records (a saved request) in progress, by lease end.
CREATE INDEX safe_retry_outcomes_stalled ON safe_retry_outcomes (locked_until)
    WHERE status = 'in_progress' AND request IS NOT NULL;

-- The transactional outbox: follow-on messages a handler staged in the transaction of a step
-- or of its answer, delivered at least once by a relay. `id` is the message's natural id (from
-- the record and the message's name), so a resumed handler that stages it again adds nothing;
-- the relay derives the delivery's idempotency key from it. `deliveries` fences a relay: a
-- relay marks a message with the count it took it under.
CREATE TABLE safe_retry_outbox (
    id            TEXT    PRIMARY KEY,
    method        TEXT    NOT NULL,
    url           TEXT    NOT NULL,
    headers       BLOB    NOT NULL,
    body          BLOB    NOT NULL,
    status        TEXT    NOT NULL
                  CHECK (status = 'pending' OR status = 'sent' OR status = 'failed'),
    deliveries    INTEGER NOT NULL DEFAULT 0,
    available_at  INTEGER NOT NULL,
    answer_status INTEGER,
    last_error    TEXT,
    created_at    INTEGER NOT NULL,
    expires_at    INTEGER
);
CREATE INDEX safe_retry_outbox_due ON safe_retry_outbox (available_at) WHERE status = 'pending';
CREATE INDEX safe_retry_outbox_expires_at ON safe_retry_outbox (expires_at);
