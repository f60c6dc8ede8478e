//! The embedded store: SQLite through sqlx.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Row, Sqlite, Transaction};

use bytes::Bytes;

use super::operations::{Operations, RecordView, Standing, Tally, view_of};
use super::{
    Claim, Claimed, Completion, Fence, Outbox, OutboxMessage, Outcomes, Progress, Record,
    RecoveryPoints, Settle, StagedMessage, Stalled, StepWrite, StoreError, StoredAnswer,
    encode_headers, end_fenced, message_of, millis, record_of, settle_columns, stalled_of,
};

/// The database's clock in milliseconds since the Unix epoch, as every statement reads it.
macro_rules! now_ms {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
    };
}

/// Whether a claim renews the record `o` (a new generation): its retention has ended, and it is
/// not in progress at a recovery point.
macro_rules! renews {
    () => {
        concat!(
            "(o.expires_at <= ",
            now_ms!(),
            " AND NOT (o.status = 'in_progress' AND o.step IS NOT NULL))"
        )
    };
}

const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../../migrations/sqlite/0001_outcomes.sql")),
    (
        2,
        include_str!("../../migrations/sqlite/0002_generations.sql"),
    ),
    (3, include_str!("../../migrations/sqlite/0003_identity.sql")),
    (4, include_str!("../../migrations/sqlite/0004_notes.sql")),
];

/// The outcome table in SQLite: the embedded default, for one process (or several on one
/// machine sharing a file).
///
/// Lease decisions read SQLite's clock, which is the machine's. Handlers' transactions begin
/// with `BEGIN IMMEDIATE`, so two of them never deadlock upgrading a read to a write; SQLite
/// runs one writing transaction at a time, so a handler that holds its [`Local`](crate::execution::Local)
/// transaction through a slow call holds every other writer back: take it last.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    /// Deletes at most `batch` expired records and at most `batch` expired outbox messages
    /// ([`Outcomes::sweep`], callable without the trait in scope); a [`Sweeper`](crate::Sweeper)
    /// calls it on a schedule.
    pub async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        Outcomes::sweep(self, batch).await
    }

    /// Opens (creating it if missing) the database at `url` (`sqlite://path/to/file.db`, or a
    /// bare path) with the defaults of [`SqliteStore::builder`], and applies the migrations.
    pub async fn open(url: &str) -> Result<SqliteStore, StoreError> {
        SqliteStore::builder(url).open().await
    }

    /// Sets up how the database at `url` is opened: [`busy_timeout`](SqliteBuilder::busy_timeout),
    /// [`max_connections`](SqliteBuilder::max_connections) and
    /// [`secure_delete`](SqliteBuilder::secure_delete).
    pub fn builder(url: &str) -> SqliteBuilder {
        SqliteBuilder {
            url: url.to_owned(),
            busy_timeout: Duration::from_secs(5),
            max_connections: 8,
            secure_delete: true,
        }
    }

    /// An in-memory database for one process, with the migrations applied. It lives on one
    /// connection, so requests take turns at the database, and a handler must not use another
    /// connection of the same pool while it holds its [`Local`](crate::execution::Local) transaction.
    pub async fn memory() -> Result<SqliteStore, StoreError> {
        let options =
            SqliteConnectOptions::from_str("sqlite::memory:")?.pragma("secure_delete", "ON");
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        let store = SqliteStore { pool };
        store.migrate().await?;
        Ok(store)
    }

    /// A store on a pool the application made. Call [`migrate`](SqliteStore::migrate) once
    /// before the first request.
    pub fn from_pool(pool: SqlitePool) -> SqliteStore {
        SqliteStore { pool }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Applies the crate's migrations that this database has not seen, in one transaction.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query("CREATE TABLE IF NOT EXISTS safe_retry_schema (version INTEGER PRIMARY KEY)")
            .execute(&mut *tx)
            .await?;
        let applied: i64 =
            sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) FROM safe_retry_schema")
                .fetch_one(&mut *tx)
                .await?;
        for &(version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > applied) {
            sqlx::raw_sql(sql).execute(&mut *tx).await?;
            sqlx::query("INSERT INTO safe_retry_schema (version) VALUES (?)")
                .bind(version)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// How a [`SqliteStore`] opens its database file (WAL mode, created if missing).
#[derive(Debug, Clone)]
pub struct SqliteBuilder {
    url: String,
    busy_timeout: Duration,
    max_connections: u32,
    secure_delete: bool,
}

impl SqliteBuilder {
    /// How long a statement waits for SQLite's one writer before it fails [5 s], and how long
    /// a request waits for one of the pool's connections. A claim, a handler's `BEGIN
    /// IMMEDIATE` and a completion behind a writer that does not finish fail within twice it
    /// (the pool's wait, when every connection is waiting too, then SQLite's), and the request
    /// is answered `503 store-unavailable` with nothing stored; a copy of a completed request
    /// is read without the lock (within 250 ms more) and gets its replay. A statement is never
    /// cut short while SQLite may still run it: it would commit after its request had been
    /// answered.
    pub fn busy_timeout(mut self, timeout: Duration) -> SqliteBuilder {
        self.busy_timeout = timeout;
        self
    }

    /// The pool's connections \[8\]: requests in flight at once that hold one (a claim, a
    /// handler's transaction, a completion).
    pub fn max_connections(mut self, connections: u32) -> SqliteBuilder {
        self.max_connections = connections.max(1);
        self
    }

    /// SQLite's `secure_delete` \[on\]: what a completion clears (the saved request, with the
    /// headers it kept for a resumption) and what a sweep deletes is overwritten with zeros
    /// in the file, not left in its free pages for anyone who reads the file. It costs writes
    /// of the cleared pages; turn it off only for a file nobody else can read.
    pub fn secure_delete(mut self, on: bool) -> SqliteBuilder {
        self.secure_delete = on;
        self
    }

    /// Opens the database and applies the migrations. Several processes may open one new
    /// file at once: a first connection that meets another's switch to WAL mode (which SQLite
    /// answers "database is locked" at once, without waiting) tries again, within the busy
    /// timeout.
    pub async fn open(self) -> Result<SqliteStore, StoreError> {
        let options = SqliteConnectOptions::from_str(&self.url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(self.busy_timeout)
            .pragma(
                "secure_delete",
                if self.secure_delete { "ON" } else { "OFF" },
            );
        let until = tokio::time::Instant::now() + self.busy_timeout;
        loop {
            let opened = async {
                let pool = SqlitePoolOptions::new()
                    .max_connections(self.max_connections)
                    .acquire_timeout(self.busy_timeout)
                    .connect_with(options.clone())
                    .await?;
                let store = SqliteStore { pool };
                store.migrate().await?;
                Ok::<_, StoreError>(store)
            };
            match opened.await {
                Err(error) if is_busy(&error) && tokio::time::Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                opened => return opened,
            }
        }
    }
}

/// Whether SQLite answered `SQLITE_BUSY` ("database is locked").
fn is_busy(error: &StoreError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<sqlx::Error>())
        .and_then(|error| error.as_database_error())
        .and_then(|error| error.code())
        .is_some_and(|code| code == "5")
}

impl Outcomes for SqliteStore {
    type Tx = Transaction<'static, Sqlite>;

    async fn try_claim(&self, claim: &Claim<'_>) -> Result<Option<Claimed>, StoreError> {
        // A record renews (a new generation: a new identity, no steps) when its retention has
        // ended, unless it is in progress at a recovery point: the effects its steps began may
        // have happened, so it is only ever taken over (its retention starting again), never
        // started afresh.
        let row = sqlx::query(concat!(
            "INSERT INTO safe_retry_outcomes AS o
                (scope, key, fingerprint, status, attempt, generation, locked_until, created_at,
                 expires_at, identity)
             VALUES (?1, ?2, ?3, 'in_progress', 1, 1, ",
            now_ms!(),
            " + ?4, ",
            now_ms!(),
            ", ",
            now_ms!(),
            " + ?5, lower(hex(randomblob(16))))
             ON CONFLICT (scope, key) DO UPDATE SET
                attempt = o.attempt + 1,
                generation = CASE WHEN ",
            renews!(),
            " THEN o.attempt + 1 ELSE o.generation END,
                takeovers = CASE WHEN ",
            renews!(),
            " THEN 0 ELSE o.takeovers + 1 END,
                identity = CASE WHEN ",
            renews!(),
            " THEN excluded.identity ELSE o.identity END,
                locked_until = excluded.locked_until,
                status = 'in_progress',
                fingerprint = excluded.fingerprint,
                response_status = NULL, response_headers = NULL, response_body = NULL,
                step = CASE WHEN ",
            renews!(),
            " THEN NULL ELSE o.step END,
                steps = CASE WHEN ",
            renews!(),
            " THEN NULL ELSE o.steps END,
                request = CASE WHEN ",
            renews!(),
            " THEN NULL ELSE o.request END,
                created_at = CASE WHEN ",
            renews!(),
            " THEN excluded.created_at ELSE o.created_at END,
                expires_at = CASE WHEN o.expires_at <= ",
            now_ms!(),
            " THEN excluded.expires_at ELSE o.expires_at END
             WHERE (",
            renews!(),
            " AND (o.status <> 'in_progress' OR o.locked_until <= ",
            now_ms!(),
            "))
                OR (o.status = 'in_progress' AND o.locked_until <= ",
            now_ms!(),
            " AND o.fingerprint = excluded.fingerprint)
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
        let row = sqlx::query(concat!(
            "SELECT fingerprint, identity, status, response_status, response_headers, response_body,
                    MAX(0, COALESCE(locked_until, 0) - ",
            now_ms!(),
            ") AS lease_left
             FROM safe_retry_outcomes WHERE scope = ?1 AND key = ?2"
        ))
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
        Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
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
                 response_status = ?3, response_headers = ?4, response_body = ?5
             WHERE id = ?1 AND attempt = ?2 AND status = 'in_progress'",
        )
        .bind(fence.id)
        .bind(fence.attempt)
        .bind(i64::from(answer.status.as_u16()))
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
            "DELETE FROM safe_retry_outcomes WHERE id = ?1 AND attempt = ?2 AND status = 'in_progress'",
        )
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn abandon(&self, fence: Fence) -> Result<bool, StoreError> {
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outcomes SET locked_until = ",
            now_ms!(),
            "
             WHERE id = ?1 AND attempt = ?2 AND status = 'in_progress'"
        ))
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        let done = sqlx::query(concat!(
            "DELETE FROM safe_retry_outcomes WHERE id IN (
                SELECT id FROM safe_retry_outcomes
                WHERE expires_at <= ",
            now_ms!(),
            "
                  AND (status <> 'in_progress' OR (locked_until <= ",
            now_ms!(),
            " AND step IS NULL))
                ORDER BY expires_at LIMIT ?1)"
        ))
        .bind(i64::from(batch))
        .execute(&self.pool)
        .await?;
        let messages = sqlx::query(concat!(
            "DELETE FROM safe_retry_outbox WHERE id IN (
                SELECT id FROM safe_retry_outbox WHERE expires_at <= ",
            now_ms!(),
            " ORDER BY expires_at LIMIT ?1)"
        ))
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
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outcomes
             SET status = 'failed', locked_until = NULL, request = NULL,
                 response_status = ?3, response_headers = ?4, response_body = ?5,
                 expires_at = ",
            now_ms!(),
            " + ?6
             WHERE id = ?1 AND attempt = ?2 AND status = 'in_progress'"
        ))
        .bind(fence.id)
        .bind(fence.attempt)
        .bind(i64::from(answer.status.as_u16()))
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

impl RecoveryPoints for SqliteStore {
    async fn progress(&self, fence: Fence) -> Result<Progress, StoreError> {
        let row = sqlx::query("SELECT steps, request FROM safe_retry_outcomes WHERE id = ?1")
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
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outcomes
             SET step = ?3, steps = COALESCE(?4, steps), request = COALESCE(request, ?5),
                 locked_until = ",
            now_ms!(),
            " + ?6
             WHERE id = ?1 AND attempt = ?2 AND status = 'in_progress'"
        ))
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
        let rows = sqlx::query(concat!(
            "SELECT scope, key, fingerprint FROM safe_retry_outcomes
             WHERE status = 'in_progress' AND request IS NOT NULL
               AND locked_until <= ",
            now_ms!(),
            "
             ORDER BY locked_until LIMIT ?1"
        ))
        .bind(i64::from(batch))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(stalled_of).collect()
    }
}

impl Outbox for SqliteStore {
    async fn stage(
        &self,
        tx: &mut Self::Tx,
        message: &StagedMessage<'_>,
    ) -> Result<(), StoreError> {
        sqlx::query(concat!(
            "INSERT INTO safe_retry_outbox
                (id, method, url, headers, body, status, available_at, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, 'pending', ",
            now_ms!(),
            ", ",
            now_ms!(),
            ")
             ON CONFLICT (id) DO NOTHING"
        ))
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
        // One statement: SQLite runs one writer at a time, so two relays never take one row.
        let rows = sqlx::query(concat!(
            "UPDATE safe_retry_outbox
             SET deliveries = deliveries + 1, available_at = ",
            now_ms!(),
            " + ?2
             WHERE id IN (
                SELECT id FROM safe_retry_outbox
                WHERE status = 'pending' AND available_at <= ",
            now_ms!(),
            "
                ORDER BY available_at LIMIT ?1)
             RETURNING id, method, url, headers, body, deliveries"
        ))
        .bind(i64::from(batch))
        .bind(millis(lease))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(message_of).collect()
    }

    async fn settle(&self, id: &str, delivery: i64, settle: &Settle) -> Result<bool, StoreError> {
        let (status, answer, error, keep, after) = settle_columns(settle);
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outbox
             SET status = ?3, answer_status = COALESCE(?4, answer_status),
                 last_error = ?5,
                 expires_at = CASE WHEN ?6 IS NULL THEN NULL ELSE ",
            now_ms!(),
            " + ?6 END,
                 available_at = CASE WHEN ?7 IS NULL THEN available_at ELSE ",
            now_ms!(),
            " + ?7 END
             WHERE id = ?1 AND deliveries = ?2 AND status = 'pending'"
        ))
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
        concat!(
            "SELECT scope, key, status, step, steps, request, attempt, generation, note,
                    response_status, created_at AS created_ms, expires_at AS expires_ms,
                    locked_until AS lease_ms,
                    MAX(0, COALESCE(locked_until, 0) - ",
            now_ms!(),
            ") AS lease_left
             FROM safe_retry_outcomes "
        )
    };
}

impl Operations for SqliteStore {
    async fn records(&self, standing: Standing, limit: u32) -> Result<Vec<RecordView>, StoreError> {
        let sql = match standing {
            Standing::Running => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until > ",
                now_ms!(),
                " ORDER BY id LIMIT ?1"
            ),
            Standing::Stalled => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until <= ",
                now_ms!(),
                " AND step IS NULL ORDER BY id LIMIT ?1"
            ),
            Standing::Parked => concat!(
                view_columns!(),
                "WHERE status = 'in_progress' AND locked_until <= ",
                now_ms!(),
                " AND step IS NOT NULL ORDER BY id LIMIT ?1"
            ),
            Standing::Failed => concat!(
                view_columns!(),
                "WHERE status = 'failed' ORDER BY id LIMIT ?1"
            ),
            Standing::Completed => concat!(
                view_columns!(),
                "WHERE status = 'completed' ORDER BY id LIMIT ?1"
            ),
        };
        let rows = sqlx::query(sql)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(view_of).collect()
    }

    async fn inspect(&self, scope: &str, key: &str) -> Result<Option<RecordView>, StoreError> {
        let row = sqlx::query(concat!(view_columns!(), "WHERE scope = ?1 AND key = ?2"))
            .bind(scope)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(view_of).transpose()
    }

    async fn tally(&self) -> Result<Tally, StoreError> {
        let rows: Vec<(String, i64, bool, i64)> = sqlx::query_as(concat!(
            "SELECT status, COALESCE(locked_until > ",
            now_ms!(),
            ", 0) AS live, step IS NOT NULL, count(*)
             FROM safe_retry_outcomes GROUP BY 1, 2, 3"
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(Tally::of_rows(rows))
    }

    async fn retry_now(&self, scope: &str, key: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outcomes SET locked_until = ",
            now_ms!(),
            ", generation = attempt + 1
             WHERE scope = ?1 AND key = ?2 AND status = 'in_progress' AND locked_until <= ",
            now_ms!()
        ))
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
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outcomes
             SET status = 'failed', locked_until = NULL, request = NULL, note = ?3,
                 response_status = ?4, response_headers = ?5, response_body = ?6,
                 expires_at = ",
            now_ms!(),
            " + ?7
             WHERE scope = ?1 AND key = ?2
               AND (status = 'failed' OR (status = 'in_progress' AND locked_until <= ",
            now_ms!(),
            "))"
        ))
        .bind(scope)
        .bind(key)
        .bind(reason)
        .bind(i64::from(answer.status.as_u16()))
        .bind(encode_headers(&answer.headers))
        .bind(answer.body.as_deref())
        .bind(millis(retention))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }
}
