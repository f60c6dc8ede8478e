//! The fleet store: PostgreSQL through sqlx.

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Postgres, Row, Transaction};

use bytes::Bytes;

use super::operations::{Operations, RecordView, Standing, Tally, view_of};
use super::{
    Claim, Claimed, Completion, Fence, Outbox, OutboxMessage, Outcomes, Progress, Record,
    RecoveryPoints, Settle, StagedMessage, Stalled, StepWrite, StoreError, StoredAnswer,
    encode_headers, end_fenced, message_of, millis, record_of, settle_columns, stalled_of,
};

/// Whether a claim renews the record `o` (a new generation): its retention has ended, and it is
/// not in progress at a recovery point.
macro_rules! renews {
    () => {
        "(o.expires_at <= now() AND NOT (o.status = 'in_progress' AND o.step IS NOT NULL))"
    };
}

const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        include_str!("../../migrations/postgres/0001_outcomes.sql"),
    ),
    (
        2,
        include_str!("../../migrations/postgres/0002_generations.sql"),
    ),
    (
        3,
        include_str!("../../migrations/postgres/0003_identity.sql"),
    ),
    (4, include_str!("../../migrations/postgres/0004_notes.sql")),
];

/// The advisory lock that serialises servers of a fleet migrating the same database at once
/// (a constant: the bytes of "safe-rtr").
const MIGRATION_LOCK: i64 = 0x7361_6665_2d72_7472;

/// The outcome table in PostgreSQL, shared by every server of a fleet.
///
/// Every lease decision reads `now()` inside the statement that makes it, so servers whose own
/// clocks disagree still agree on who holds a key. Statements run at READ COMMITTED: a
/// completion and a takeover of the same row meet on its row lock, and whichever commits
/// second finds the record changed and writes nothing.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// Deletes at most `batch` expired records and at most `batch` expired outbox messages
    /// ([`Outcomes::sweep`], callable without the trait in scope); a [`Sweeper`](crate::Sweeper)
    /// calls it on a schedule.
    pub async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        Outcomes::sweep(self, batch).await
    }

    /// Connects to `url` (`postgres://user@host/database`) with a pool of 16 connections and
    /// applies the migrations.
    pub async fn connect(url: &str) -> Result<PostgresStore, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await?;
        let store = PostgresStore { pool };
        store.migrate().await?;
        Ok(store)
    }

    /// A store on a pool the application made. Call [`migrate`](PostgresStore::migrate) once
    /// before the first request.
    pub fn from_pool(pool: PgPool) -> PostgresStore {
        PostgresStore { pool }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the crate's migrations that this database has not seen, in one transaction,
    /// under an advisory lock so that servers starting together apply each once.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATION_LOCK)
            .execute(&mut *tx)
            .await?;
        sqlx::query("CREATE TABLE IF NOT EXISTS safe_retry_schema (version BIGINT PRIMARY KEY)")
            .execute(&mut *tx)
            .await?;
        let applied: i64 =
            sqlx::query_scalar("SELECT COALESCE(MAX(version), 0)::BIGINT FROM safe_retry_schema")
                .fetch_one(&mut *tx)
                .await?;
        for &(version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > applied) {
            sqlx::raw_sql(sql).execute(&mut *tx).await?;
            sqlx::query("INSERT INTO safe_retry_schema (version) VALUES ($1)")
                .bind(version)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

impl Outcomes for PostgresStore {
    type Tx = Transaction<'static, Postgres>;

    async fn try_claim(&self, claim: &Claim<'_>) -> Result<Option<Claimed>, StoreError> {
        // A row another transaction holds locked (a holder frozen between its write and its
        // commit) is passed by, not waited for: `held` skips it, and the insert then adds
        // nothing, so the claim answers at once and the request reads the record (a `409`
        // while it is in progress). Only a row this statement could lock, or no row, is claimed.
        // A record renews (a new generation: a new identity, no steps) when its retention has
        // ended, unless it is in progress at a recovery point: the effects its steps began may
        // have happened, so it is only ever taken over (its retention starting again), never
        // started afresh.
        let row = sqlx::query(concat!(
            "WITH held AS (
                SELECT id FROM safe_retry_outcomes WHERE scope = $1 AND key = $2
                FOR UPDATE SKIP LOCKED
             )
             INSERT INTO safe_retry_outcomes AS o
                (scope, key, fingerprint, status, attempt, generation, locked_until, created_at,
                 expires_at, identity)
             SELECT $1, $2, $3, 'in_progress', 1, 1,
                    now() + $4::BIGINT * INTERVAL '1 millisecond', now(),
                    now() + $5::BIGINT * INTERVAL '1 millisecond',
                    replace(gen_random_uuid()::TEXT, '-', '')
             WHERE EXISTS (SELECT 1 FROM held)
                OR NOT EXISTS (SELECT 1 FROM safe_retry_outcomes WHERE scope = $1 AND key = $2)
             ON CONFLICT (scope, key) DO UPDATE SET
                attempt = o.attempt + 1,
                generation = CASE WHEN ", renews!(), " THEN o.attempt + 1 ELSE o.generation END,
                takeovers = CASE WHEN ", renews!(), " THEN 0 ELSE o.takeovers + 1 END,
                identity = CASE WHEN ", renews!(), " THEN excluded.identity ELSE o.identity END,
                locked_until = excluded.locked_until,
                status = 'in_progress',
                fingerprint = excluded.fingerprint,
                response_status = NULL, response_headers = NULL, response_body = NULL,
                step = CASE WHEN ", renews!(), " THEN NULL ELSE o.step END,
                steps = CASE WHEN ", renews!(), " THEN NULL ELSE o.steps END,
                request = CASE WHEN ", renews!(), " THEN NULL ELSE o.request END,
                created_at = CASE WHEN ", renews!(), " THEN excluded.created_at ELSE o.created_at END,
                expires_at = CASE WHEN o.expires_at <= now() THEN excluded.expires_at ELSE o.expires_at END
             WHERE (", renews!(), " AND (o.status <> 'in_progress' OR o.locked_until <= now()))
                OR (o.status = 'in_progress' AND o.locked_until <= now() AND o.fingerprint = excluded.fingerprint)
             RETURNING id, attempt, generation, identity, takeovers > 0 AS taken_over"
        ))
        .bind(claim.scope)
        .bind(claim.key)
        .bind(&claim.fingerprint[..])
        .bind(millis(claim.lease))
        .bind(millis(claim.retention))
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            None => None,
            Some(row) => Some(Claimed {
                fence: Fence {
                    id: row.try_get("id")?,
                    attempt: row.try_get("attempt")?,
                },
                generation: row.try_get("generation")?,
                identity: row.try_get("identity")?,
                taken_over: row.try_get("taken_over")?,
            }),
        })
    }

    async fn read(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(
            "SELECT fingerprint, identity, status, response_status::BIGINT AS response_status,
                    response_headers, response_body,
                    GREATEST(0, CEIL(EXTRACT(EPOCH FROM (COALESCE(locked_until, now()) - now())) * 1000))::BIGINT
                        AS lease_left
             FROM safe_retry_outcomes WHERE scope = $1 AND key = $2",
        )
        .bind(scope)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        Ok(Some(record_of(
            &row.try_get::<Vec<u8>, _>("fingerprint")?,
            &row.try_get::<String, _>("status")?,
            row.try_get("response_status")?,
            row.try_get("response_headers")?,
            row.try_get("response_body")?,
            row.try_get("lease_left")?,
            row.try_get("identity")?,
        )?))
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        Ok(self.pool.begin().await?)
    }

    async fn complete(
        &self,
        tx: Option<Self::Tx>,
        fence: Fence,
        answer: &StoredAnswer,
    ) -> Result<Completion, StoreError> {
        let mut tx = match tx {
            Some(tx) => tx,
            None => self.begin().await?,
        };
        let done = sqlx::query(
            "UPDATE safe_retry_outcomes
             SET status = 'completed', locked_until = NULL, request = NULL, steps = NULL,
                 response_status = $3, response_headers = $4, response_body = $5
             WHERE id = $1 AND attempt = $2 AND status = 'in_progress'",
        )
        .bind(fence.id)
        .bind(fence.attempt)
        .bind(i32::from(answer.status.as_u16()))
        .bind(encode_headers(&answer.headers))
        .bind(answer.body.as_deref())
        .execute(&mut *tx)
        .await?;
        end_fenced(tx, done.rows_affected()).await
    }

    async fn release(&self, tx: Option<Self::Tx>, fence: Fence) -> Result<bool, StoreError> {
        if let Some(tx) = tx {
            tx.rollback().await?;
        }
        let done = sqlx::query(
            "DELETE FROM safe_retry_outcomes WHERE id = $1 AND attempt = $2 AND status = 'in_progress'",
        )
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn abandon(&self, fence: Fence) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE safe_retry_outcomes SET locked_until = now()
             WHERE id = $1 AND attempt = $2 AND status = 'in_progress'",
        )
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM safe_retry_outcomes WHERE id IN (
                SELECT id FROM safe_retry_outcomes
                WHERE expires_at <= now()
                  AND (status <> 'in_progress' OR (locked_until <= now() AND step IS NULL))
                ORDER BY expires_at LIMIT $1
                FOR UPDATE SKIP LOCKED)",
        )
        .bind(i64::from(batch))
        .execute(&self.pool)
        .await?;
        let messages = sqlx::query(
            "DELETE FROM safe_retry_outbox WHERE id IN (
                SELECT id FROM safe_retry_outbox WHERE expires_at <= now()
                ORDER BY expires_at LIMIT $1
                FOR UPDATE SKIP LOCKED)",
        )
        .bind(i64::from(batch))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() + messages.rows_affected())
    }

    async fn fail(
        &self,
        fence: Fence,
        answer: &StoredAnswer,
        retention: Duration,
    ) -> Result<Completion, StoreError> {
        let done = sqlx::query(
            "UPDATE safe_retry_outcomes
             SET status = 'failed', locked_until = NULL, request = NULL,
                 response_status = $3, response_headers = $4, response_body = $5,
                 expires_at = now() + $6::BIGINT * INTERVAL '1 millisecond'
             WHERE id = $1 AND attempt = $2 AND status = 'in_progress'",
        )
        .bind(fence.id)
        .bind(fence.attempt)
        .bind(i32::from(answer.status.as_u16()))
        .bind(encode_headers(&answer.headers))
        .bind(answer.body.as_deref())
        .bind(millis(retention))
        .execute(&self.pool)
        .await?;
        Ok(if done.rows_affected() == 0 {
            Completion::Fenced
        } else {
            Completion::Completed
        })
    }
}

impl RecoveryPoints for PostgresStore {
    async fn progress(&self, fence: Fence) -> Result<Progress, StoreError> {
        let row = sqlx::query("SELECT steps, request FROM safe_retry_outcomes WHERE id = $1")
            .bind(fence.id)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else {
            return Ok(Progress::default());
        };
        Ok(Progress {
            steps: row.try_get("steps")?,
            request: row
                .try_get::<Option<Vec<u8>>, _>("request")?
                .map(Bytes::from),
        })
    }

    async fn commit_step(
        &self,
        tx: Option<Self::Tx>,
        fence: Fence,
        write: &StepWrite<'_>,
    ) -> Result<Completion, StoreError> {
        let mut tx = match tx {
            Some(tx) => tx,
            None => self.begin().await?,
        };
        let done = sqlx::query(
            "UPDATE safe_retry_outcomes
             SET step = $3, steps = COALESCE($4, steps), request = COALESCE(request, $5),
                 locked_until = now() + $6::BIGINT * INTERVAL '1 millisecond'
             WHERE id = $1 AND attempt = $2 AND status = 'in_progress'",
        )
        .bind(fence.id)
        .bind(fence.attempt)
        .bind(write.point)
        .bind(write.steps)
        .bind(write.request)
        .bind(millis(write.lease))
        .execute(&mut *tx)
        .await?;
        end_fenced(tx, done.rows_affected()).await
    }

    async fn stalled(&self, batch: u32) -> Result<Vec<Stalled>, StoreError> {
        let rows = sqlx::query(
            "SELECT scope, key, fingerprint FROM safe_retry_outcomes
             WHERE status = 'in_progress' AND request IS NOT NULL
               AND locked_until <= now()
             ORDER BY locked_until LIMIT $1",
        )
        .bind(i64::from(batch))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(stalled_of).collect()
    }
}

impl Outbox for PostgresStore {
    async fn stage(
        &self,
        tx: &mut Self::Tx,
        message: &StagedMessage<'_>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO safe_retry_outbox
                (id, method, url, headers, body, status, available_at, created_at)
             VALUES ($1, $2, $3, $4, $5, 'pending', now(), now())
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(message.id)
        .bind(message.method)
        .bind(message.url)
        .bind(encode_headers(message.headers))
        .bind(message.body)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn take_messages(
        &self,
        batch: u32,
        lease: Duration,
    ) -> Result<Vec<OutboxMessage>, StoreError> {
        // SKIP LOCKED: relays on every server take disjoint batches without waiting.
        let rows = sqlx::query(
            "UPDATE safe_retry_outbox
             SET deliveries = deliveries + 1,
                 available_at = now() + $2::BIGINT * INTERVAL '1 millisecond'
             WHERE id IN (
                SELECT id FROM safe_retry_outbox
                WHERE status = 'pending' AND available_at <= now()
                ORDER BY available_at LIMIT $1
                FOR UPDATE SKIP LOCKED)
             RETURNING id, method, url, headers, body, deliveries",
        )
        .bind(i64::from(batch))
        .bind(millis(lease))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(message_of).collect()
    }

    async fn settle(&self, id: &str, delivery: i64, settle: &Settle) -> Result<bool, StoreError> {
        let (status, answer, error, keep, after) = settle_columns(settle);
        let done = sqlx::query(
            "UPDATE safe_retry_outbox
             SET status = $3, answer_status = COALESCE($4, answer_status), last_error = $5,
                 expires_at = now() + $6::BIGINT * INTERVAL '1 millisecond',
                 available_at = COALESCE(now() + $7::BIGINT * INTERVAL '1 millisecond', available_at)
             WHERE id = $1 AND deliveries = $2 AND status = 'pending'",
        )
        .bind(id)
        .bind(delivery)
        .bind(status)
        .bind(answer)
        .bind(error)
        .bind(keep)
        .bind(after)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// The columns of a record's view ([`super::operations::view_of`]).
macro_rules! view_columns {
    () => {
        "SELECT scope, key, status, step, steps, request, attempt, generation, note,
                response_status::BIGINT AS response_status,
                (EXTRACT(EPOCH FROM created_at) * 1000)::BIGINT AS created_ms,
                (EXTRACT(EPOCH FROM expires_at) * 1000)::BIGINT AS expires_ms,
                (EXTRACT(EPOCH FROM locked_until) * 1000)::BIGINT AS lease_ms,
                GREATEST(0, CEIL(EXTRACT(EPOCH FROM (COALESCE(locked_until, now()) - now())) * 1000))::BIGINT
                    AS lease_left
         FROM safe_retry_outcomes "
    };
}

impl Operations for PostgresStore {
    async fn records(&self, standing: Standing, limit: u32) -> Result<Vec<RecordView>, StoreError> {
        let sql = match standing {
            Standing::Running => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until > now() ORDER BY id LIMIT $1"
            ),
            Standing::Stalled => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until <= now() AND step IS NULL
                 ORDER BY id LIMIT $1"
            ),
            Standing::Parked => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until <= now() AND step IS NOT NULL
                 ORDER BY id LIMIT $1"
            ),
            Standing::Failed => concat!(
                view_columns!(),
                "WHERE status = 'failed' ORDER BY id LIMIT $1"
            ),
            Standing::Completed => concat!(
                view_columns!(),
                "WHERE status = 'completed' ORDER BY id LIMIT $1"
            ),
        };
        let rows = sqlx::query(sql)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(view_of).collect()
    }

    async fn inspect(&self, scope: &str, key: &str) -> Result<Option<RecordView>, StoreError> {
        let row = sqlx::query(concat!(view_columns!(), "WHERE scope = $1 AND key = $2"))
            .bind(scope)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(view_of).transpose()
    }

    async fn tally(&self) -> Result<Tally, StoreError> {
        let rows: Vec<(String, i64, bool, i64)> = sqlx::query_as(
            "SELECT status, COALESCE((locked_until > now())::INT, 0)::BIGINT AS live, step IS NOT NULL, count(*)
             FROM safe_retry_outcomes GROUP BY 1, 2, 3",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(Tally::of_rows(rows))
    }

    async fn retry_now(&self, scope: &str, key: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE safe_retry_outcomes SET locked_until = now(), generation = attempt + 1
             WHERE scope = $1 AND key = $2 AND status = 'in_progress' AND locked_until <= now()",
        )
        .bind(scope)
        .bind(key)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn abandon_record(
        &self,
        scope: &str,
        key: &str,
        reason: &str,
        answer: &StoredAnswer,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE safe_retry_outcomes
             SET status = 'failed', locked_until = NULL, request = NULL, note = $3,
                 response_status = $4, response_headers = $5, response_body = $6,
                 expires_at = now() + $7::BIGINT * INTERVAL '1 millisecond'
             WHERE scope = $1 AND key = $2
               AND (status = 'failed' OR (status = 'in_progress' AND locked_until <= now()))",
        )
        .bind(scope)
        .bind(key)
        .bind(reason)
        .bind(i32::from(answer.status.as_u16()))
        .bind(encode_headers(&answer.headers))
        .bind(answer.body.as_deref())
        .bind(millis(retention))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}
