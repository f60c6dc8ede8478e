-- The outcome table: one row per (scope, key). `step` names the last recovery point reached
-- (`name:started` before an external call, `name:done` after its step committed), `steps` holds
-- the committed steps' outputs (a JSON object by step name), `request` the request a resumption
-- runs again (saved with the first recovery point). Times come from the database's clock, so the
-- servers of a fleet agree on every lease. `id` is never reused (a sequence), so (id, attempt)
-- fences a holder across a sweep and a new claim of the same key.
CREATE TABLE safe_retry_outcomes (
    id               BIGSERIAL   PRIMARY KEY,
    scope            TEXT        NOT NULL,
    key              TEXT        NOT NULL,
    fingerprint      BYTEA       NOT NULL,
    status           TEXT        NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
    attempt          BIGINT      NOT NULL,
    takeovers        BIGINT      NOT NULL DEFAULT 0,
    locked_until     TIMESTAMPTZ,
    response_status  INTEGER,
    response_headers BYTEA,
    response_body    BYTEA,
    step             TEXT,
    steps            TEXT,
    request          BYTEA,
    created_at       TIMESTAMPTZ NOT NULL,
    expires_at       TIMESTAMPTZ NOT NULL,
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
    id            TEXT        PRIMARY KEY,
    method        TEXT        NOT NULL,
    url           TEXT        NOT NULL,
    headers       BYTEA       NOT NULL,
    body          BYTEA       NOT NULL,
    status        TEXT        NOT NULL CHECK (status IN ('pending', 'sent', 'failed')),
    deliveries    BIGINT      NOT NULL DEFAULT 0,
    available_at  TIMESTAMPTZ NOT NULL,
    answer_status INTEGER,
    last_error    TEXT,
    created_at    TIMESTAMPTZ NOT NULL,
    expires_at    TIMESTAMPTZ
);
CREATE INDEX safe_retry_outbox_due ON safe_retry_outbox (available_at) WHERE status = 'pending';
CREATE INDEX safe_retry_outbox_expires_at ON safe_retry_outbox (expires_at);
