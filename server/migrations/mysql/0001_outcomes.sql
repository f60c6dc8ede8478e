-- The outcome table on MySQL 8 or MariaDB 10.11+: the shape the PostgreSQL table reached after
-- its four migrations, made in one statement (MySQL commits each DDL statement on its own, so a
-- migration is a list of statements each safe to run again). `scope` and `key` are bytes compared
-- byte for byte: a text collation would make `Key`, `key` and `key ` one key. Times are UTC
-- (`UTC_TIMESTAMP(3)`, whatever the session's time zone), read in the statements themselves so
-- the servers of a fleet agree on every lease. `id` is never reused (AUTO_INCREMENT), so (id,
-- attempt) fences a holder across a sweep and a new claim of the same key.
CREATE TABLE IF NOT EXISTS safe_retry_outcomes (
    id               BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    scope            VARBINARY(1000) NOT NULL,
    `key`            VARBINARY(2000) NOT NULL,
    fingerprint      BINARY(32)     NOT NULL,
    status           VARCHAR(16)    NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
    attempt          BIGINT         NOT NULL,
    generation       BIGINT         NOT NULL DEFAULT 1,
    takeovers        BIGINT         NOT NULL DEFAULT 0,
    identity         CHAR(32)       NOT NULL,
    locked_until     DATETIME(3),
    response_status  INT,
    response_headers LONGBLOB,
    response_body    LONGBLOB,
    step             TEXT,
    steps            LONGTEXT,
    request          LONGBLOB,
    note             TEXT,
    created_at       DATETIME(3)    NOT NULL,
    expires_at       DATETIME(3)    NOT NULL,
    UNIQUE KEY safe_retry_outcomes_key (scope, `key`),
    KEY safe_retry_outcomes_expires_at (expires_at),
    -- The reconciler's search and the operator's lists: records by status and lease end.
    KEY safe_retry_outcomes_stalled (status, locked_until)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- The transactional outbox (as on PostgreSQL): `id` is the message's natural id, `deliveries`
-- fences a relay.
CREATE TABLE IF NOT EXISTS safe_retry_outbox (
    id            VARBINARY(768) NOT NULL PRIMARY KEY,
    method        VARCHAR(32)    NOT NULL,
    url           TEXT           NOT NULL,
    headers       LONGBLOB       NOT NULL,
    body          LONGBLOB       NOT NULL,
    status        VARCHAR(16)    NOT NULL CHECK (status IN ('pending', 'sent', 'failed')),
    deliveries    BIGINT         NOT NULL DEFAULT 0,
    available_at  DATETIME(3)    NOT NULL,
    answer_status INT,
    last_error    TEXT,
    created_at    DATETIME(3)    NOT NULL,
    expires_at    DATETIME(3),
    KEY safe_retry_outbox_due (status, available_at),
    KEY safe_retry_outbox_expires_at (expires_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
