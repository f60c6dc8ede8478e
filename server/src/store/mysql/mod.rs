//! The fleet store on MySQL 8 or MariaDB 10.11+, through sqlx.
//!
//! MySQL has no `INSERT … ON CONFLICT … WHERE … RETURNING` (MariaDB returns from an `INSERT`,
//! never from an `UPDATE`), and its upsert waits for a row another transaction holds locked.
//! So a claim is a short conversation instead of one statement, each step safe on its own:
//!
//! 1. A consistent read (no lock) of whether the key has a row, with a fresh random identity.
//! 2. No row: a plain `INSERT` (autocommitted: the claim, in one statement). A duplicate key
//!    means another claim won the race: nothing is claimed.
//! 3. A row: in a transaction, `SELECT … FOR UPDATE SKIP LOCKED` reads it with the decision
//!    (renew, take over, or neither) made on the database's clock; a row another transaction
//!    holds is passed by, not waited for. The `UPDATE` by id then writes the decided values,
//!    under the row lock the read took.
//!
//! What each statement needs of its isolation (the connections run at READ COMMITTED):
//!
//! | statement | reads | why READ COMMITTED |
//! |---|---|---|
//! | the claim's first read, `read`, the operator's reads | a consistent read, no lock | each sees what was committed when it ran, not a snapshot older than the lease it judges |
//! | the claim's `INSERT` | the unique index's duplicate check | none: it commits on its own |
//! | the claim's `SELECT … FOR UPDATE SKIP LOCKED` and `UPDATE` | the latest row, locked | a locking read of a key whose row was just deleted takes no gap lock |
//! | completion, recovery point, abandon, fail, release (fenced by id and attempt) | the row, locked | the handler's own writes share the transaction: READ COMMITTED is what they are told they get |
//! | the sweep's and the relay's `SELECT … FOR UPDATE SKIP LOCKED` | a range, locked | at REPEATABLE READ the range's gaps would be locked, holding back other servers' inserts |

use std::time::Duration;

use sqlx::mysql::{MySql, MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::pool::PoolConnectionMetadata;
use sqlx::{Executor, Row, Transaction};

use bytes::Bytes;

use super::{
    Claim, Claimed, Completion, Fence, Outcomes, Progress, Record, RecoveryPoints, Stalled,
    StepWrite, StoreError, StoredAnswer, encode_headers, end_fenced, record_of, stalled_of,
};

/// The database's clock, as every statement reads it: UTC, to the millisecond, whatever the
/// session's time zone.
macro_rules! now {
    () => {
        "UTC_TIMESTAMP(3)"
    };
}

/// `now` plus a parameter in microseconds.
macro_rules! later {
    () => {
        concat!(now!(), " + INTERVAL ? MICROSECOND")
    };
}

/// Milliseconds left until the time column `$c` (zero once passed, or when it is null).
macro_rules! left_ms {
    ($c:literal) => {
        concat!(
            "CAST(GREATEST(0, (TIMESTAMPDIFF(MICROSECOND, ",
            now!(),
            ", COALESCE(",
            $c,
            ", ",
            now!(),
            ")) + 999) DIV 1000) AS SIGNED)"
        )
    };
}

/// The time column `$c` in milliseconds since the Unix epoch (null when it is null).
macro_rules! epoch_ms {
    ($c:literal) => {
        concat!(
            "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', ",
            $c,
            ") DIV 1000 AS SIGNED)"
        )
    };
}

/// A fresh record identity: 16 random bytes from the server's generator, in hex.
macro_rules! fresh_identity {
    () => {
        "LOWER(HEX(RANDOM_BYTES(16)))"
    };
}

mod operations;
mod outbox;

const MIGRATIONS: &[(i64, &str)] = &[(
    1,
    include_str!("../../../migrations/mysql/0001_outcomes.sql"),
)];

/// The longest scope and key the table keeps, in bytes: the unique index over both must fit
/// InnoDB's 3,072 bytes.
const MAX_SCOPE: usize = 1000;
const MAX_KEY: usize = 2000;
/// The longest outbox message id, in bytes.
const MAX_MESSAGE_ID: usize = 768;

/// The outcome table in MySQL 8 or MariaDB 10.11+, shared by every server of a fleet.
///
/// Every lease decision reads `UTC_TIMESTAMP(3)` inside the statement that makes it, so servers
/// whose clocks disagree still agree on who holds a key.
///
/// **Isolation.** The store's connections run at READ COMMITTED (set on each connection as the
/// pool opens it, so the handlers' [`Local`](crate::execution::Local) transactions do too):
/// every statement of the store reads the latest committed row, and InnoDB takes no gap locks
/// for it, so a sweep's or a relay's range never holds back another server's insert. A completion and a takeover of one row meet on its row lock, and whichever
/// commits second finds the record changed and writes nothing (the fence in its `WHERE`).
///
/// **Lock waits** are bounded by `innodb_lock_wait_timeout`, set on each connection
/// ([`MySqlBuilder::lock_wait_timeout`], 5 s): a claim never waits for a row (it skips a
/// locked one), and a statement of a handler's transaction that waits longer fails, which
/// rolls the handler's transaction back and answers `503 store-unavailable` with nothing
/// stored. A deadlock (InnoDB rolls one transaction back) is the same for a handler's
/// transaction. A claim never waits for a lock another statement could be waiting on it for
/// (it reads without locks, skips locked rows, and its insert is committed on its own), so it
/// is never a deadlock's victim.
///
/// **Keys** are kept as bytes and compared byte for byte (`Key`, `key` and `key ` are three
/// keys), scopes up to 1,000 bytes and keys up to 2,000; a longer one is refused with an
/// error naming the limit, never cut short.
///
/// ```no_run
/// # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use safe_retry_server::{IdempotencyLayer, MySqlStore};
///
/// // Every server of the fleet opens the same database; the first to start applies the
/// // migrations, the others wait for it.
/// let store = MySqlStore::builder("mysql://orders:secret@db.internal/orders")
///     .max_connections(32)
///     .lock_wait_timeout(Duration::from_secs(2))
///     .connect()
///     .await?;
/// let layer = IdempotencyLayer::builder(store).shared_scope().build()?;
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
}

/// How a [`MySqlStore`] connects ([`MySqlStore::builder`]).
#[derive(Debug, Clone)]
pub struct MySqlBuilder {
    url: String,
    max_connections: u32,
    acquire_timeout: Duration,
    lock_wait_timeout: Duration,
}

impl MySqlBuilder {
    /// The pool's connections \[16\].
    pub fn max_connections(mut self, connections: u32) -> MySqlBuilder {
        self.max_connections = connections.max(1);
        self
    }

    /// How long a request waits for one of the pool's connections \[5 s\]; past it, the
    /// request is answered `503 store-unavailable`.
    pub fn acquire_timeout(mut self, timeout: Duration) -> MySqlBuilder {
        self.acquire_timeout = timeout;
        self
    }

    /// InnoDB's `innodb_lock_wait_timeout` on the store's connections \[5 s\], in whole
    /// seconds (at least 1, the least InnoDB takes): how long a statement waits for a row
    /// another transaction holds before it fails.
    pub fn lock_wait_timeout(mut self, timeout: Duration) -> MySqlBuilder {
        self.lock_wait_timeout = timeout;
        self
    }

    /// Connects and applies the migrations.
    pub async fn connect(self) -> Result<MySqlStore, StoreError> {
        let pool = MySqlStore::pool_options(self.lock_wait_timeout)
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .connect(&self.url)
            .await?;
        let store = MySqlStore { pool };
        store.migrate().await?;
        Ok(store)
    }
}

impl MySqlStore {
    /// Connects to `url` (`mysql://user:password@host/database`) with the defaults of
    /// [`MySqlStore::builder`] (16 connections) and applies the migrations.
    pub async fn connect(url: &str) -> Result<MySqlStore, StoreError> {
        MySqlStore::builder(url).connect().await
    }

    /// Sets up how the store connects to `url`: [`max_connections`](MySqlBuilder::max_connections),
    /// [`acquire_timeout`](MySqlBuilder::acquire_timeout) and
    /// [`lock_wait_timeout`](MySqlBuilder::lock_wait_timeout).
    pub fn builder(url: &str) -> MySqlBuilder {
        MySqlBuilder {
            url: url.to_owned(),
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            lock_wait_timeout: Duration::from_secs(5),
        }
    }

    /// The options of a pool this store can use: each connection set, as it opens, to READ
    /// COMMITTED, to wait at most `lock_wait` for a row lock, and to strict mode (a value too
    /// long for its column is an error, never cut short). A pool made elsewhere for
    /// [`from_pool`](MySqlStore::from_pool) starts from these.
    pub fn pool_options(lock_wait: Duration) -> MySqlPoolOptions {
        let seconds = lock_wait.as_secs().clamp(1, 1_073_741_824);
        MySqlPoolOptions::new().after_connect(
            move |connection: &mut MySqlConnection, _: PoolConnectionMetadata| {
                Box::pin(async move {
                    connection
                        .execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await?;
                    connection
                        .execute(sqlx::AssertSqlSafe(format!(
                            "SET SESSION innodb_lock_wait_timeout = {seconds},
                                 sql_mode = CONCAT(@@sql_mode, ',STRICT_ALL_TABLES')"
                        )))
                        .await?;
                    Ok(())
                })
            },
        )
    }

    /// A store on a pool the application made, from [`pool_options`](MySqlStore::pool_options)
    /// (a pool whose connections run at REPEATABLE READ works too, but its sweeps and relays
    /// take gap locks that hold back other servers' inserts for their short transactions).
    /// Call
    /// [`migrate`](MySqlStore::migrate) once before the first request.
    pub fn from_pool(pool: MySqlPool) -> MySqlStore {
        MySqlStore { pool }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Deletes at most `batch` expired records and at most `batch` expired outbox messages
    /// ([`Outcomes::sweep`], callable without the trait in scope); a [`Sweeper`](crate::Sweeper)
    /// calls it on a schedule.
    pub async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        Outcomes::sweep(self, batch).await
    }

    /// Applies the crate's migrations that this database has not seen, under `GET_LOCK` (named
    /// for the database) so that servers starting together on a new database apply each once.
    /// MySQL commits every DDL statement on its own: each migration is made of statements
    /// that are safe to run again, and is recorded as applied after its last one, so a server
    /// that stopped midway leaves a database the next one finishes.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut connection = self.pool.acquire().await?;
        let lock = "CONCAT('safe_retry:', LEFT(SHA2(DATABASE(), 256), 40))";
        let got: Option<i64> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT GET_LOCK({lock}, 60)")))
                .fetch_one(&mut *connection)
                .await?;
        if got != Some(1) {
            return Err(StoreError::new(
                "another server held the migration lock for 60 s: is a migration stuck?",
            ));
        }
        let applied = async {
            sqlx::query(
                "CREATE TABLE IF NOT EXISTS safe_retry_schema (version BIGINT PRIMARY KEY)",
            )
            .execute(&mut *connection)
            .await?;
            let applied: i64 = sqlx::query_scalar(
                "SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM safe_retry_schema",
            )
            .fetch_one(&mut *connection)
            .await?;
            for &(version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > applied) {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut *connection)
                    .await?;
                sqlx::query("INSERT INTO safe_retry_schema (version) VALUES (?)")
                    .bind(version)
                    .execute(&mut *connection)
                    .await?;
            }
            Ok::<_, StoreError>(())
        }
        .await;
        let released = sqlx::query(sqlx::AssertSqlSafe(format!("DO RELEASE_LOCK({lock})")))
            .execute(&mut *connection)
            .await;
        applied?;
        released?;
        Ok(())
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<Option<Claimed>, StoreError> {
        for _ in 0..3 {
            let (fresh, existing): (String, Option<i64>) = sqlx::query_as(concat!(
                "SELECT ",
                fresh_identity!(),
                ", (SELECT id FROM safe_retry_outcomes WHERE scope = ? AND `key` = ?)"
            ))
            .bind(claim.scope.as_bytes())
            .bind(claim.key.as_bytes())
            .fetch_one(&self.pool)
            .await?;
            if existing.is_none() {
                let inserted = sqlx::query(concat!(
                    "INSERT INTO safe_retry_outcomes
                        (scope, `key`, fingerprint, status, attempt, generation, locked_until,
                         created_at, expires_at, identity)
                     VALUES (?, ?, ?, 'in_progress', 1, 1, ",
                    later!(),
                    ", ",
                    now!(),
                    ", ",
                    later!(),
                    ", ?)"
                ))
                .bind(claim.scope.as_bytes())
                .bind(claim.key.as_bytes())
                .bind(&claim.fingerprint[..])
                .bind(micros(claim.lease))
                .bind(micros(claim.retention))
                .bind(&fresh)
                .execute(&self.pool)
                .await;
                return match inserted {
                    Ok(done) => Ok(Some(Claimed {
                        fence: Fence {
                            id: i64::try_from(done.last_insert_id())
                                .map_err(|_| StoreError::new("a row id past i64"))?,
                            attempt: 1,
                        },
                        generation: 1,
                        identity: fresh,
                        taken_over: false,
                    })),
                    // Another claim inserted the key first: it holds it.
                    Err(error) if code_of(&error) == Some(DUPLICATE_KEY) => Ok(None),
                    Err(error) => Err(error.into()),
                };
            }
            let mut tx = self.pool.begin().await?;
            let row = sqlx::query(concat!(
                "SELECT id, attempt, generation, takeovers, identity,
                        (expires_at <= ",
                now!(),
                " AND NOT (status = 'in_progress' AND step IS NOT NULL))
                            AS renews,
                        (status <> 'in_progress' OR locked_until <= ",
                now!(),
                ") AS free,
                        (status = 'in_progress' AND locked_until <= ",
                now!(),
                " AND fingerprint = ?)
                            AS stalled,
                        ",
                fresh_identity!(),
                " AS fresh
                 FROM safe_retry_outcomes WHERE scope = ? AND `key` = ?
                 FOR UPDATE SKIP LOCKED"
            ))
            .bind(&claim.fingerprint[..])
            .bind(claim.scope.as_bytes())
            .bind(claim.key.as_bytes())
            .fetch_optional(&mut *tx)
            .await?;
            let Some(row) = row else {
                tx.rollback().await?;
                // Held by another transaction (passed by: nothing is claimed), or deleted by
                // a sweep since the read (claimed afresh).
                let there: Option<i64> = sqlx::query_scalar(
                    "SELECT id FROM safe_retry_outcomes WHERE scope = ? AND `key` = ?",
                )
                .bind(claim.scope.as_bytes())
                .bind(claim.key.as_bytes())
                .fetch_optional(&self.pool)
                .await?;
                if there.is_some() {
                    return Ok(None);
                }
                continue;
            };
            let renews = row.try_get::<i64, _>("renews")? == 1;
            let free = row.try_get::<i64, _>("free")? == 1;
            let stalled = row.try_get::<Option<i64>, _>("stalled")? == Some(1);
            if !(renews && free || stalled) {
                tx.rollback().await?;
                return Ok(None);
            }
            let id: i64 = row.try_get("id")?;
            let attempt = row.try_get::<i64, _>("attempt")? + 1;
            let (generation, takeovers, identity) = if renews {
                (attempt, 0, row.try_get::<String, _>("fresh")?)
            } else {
                (
                    row.try_get("generation")?,
                    row.try_get::<i64, _>("takeovers")? + 1,
                    row.try_get("identity")?,
                )
            };
            sqlx::query(concat!(
                "UPDATE safe_retry_outcomes SET
                    attempt = ?, generation = ?, takeovers = ?, identity = ?,
                    locked_until = ",
                later!(),
                ",
                    status = 'in_progress', fingerprint = ?,
                    response_status = NULL, response_headers = NULL, response_body = NULL,
                    step = IF(?, NULL, step), steps = IF(?, NULL, steps),
                    request = IF(?, NULL, request),
                    created_at = IF(?, ",
                now!(),
                ", created_at),
                    expires_at = IF(expires_at <= ",
                now!(),
                ", ",
                later!(),
                ", expires_at)
                 WHERE id = ?"
            ))
            .bind(attempt)
            .bind(generation)
            .bind(takeovers)
            .bind(&identity)
            .bind(micros(claim.lease))
            .bind(&claim.fingerprint[..])
            .bind(renews)
            .bind(renews)
            .bind(renews)
            .bind(renews)
            .bind(micros(claim.retention))
            .bind(id)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Some(Claimed {
                fence: Fence { id, attempt },
                generation,
                identity,
                taken_over: takeovers > 0,
            }));
        }
        // The key's row came and went three times between two reads: another server is
        // claiming and releasing it; this claim takes nothing.
        Ok(None)
    }
}

/// MySQL's error number for a duplicate key.
const DUPLICATE_KEY: u16 = 1062;

/// The server's error number of a failed statement.
fn code_of(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .map(|e| e.number())
}

/// A duration in whole microseconds of whole milliseconds, for `INTERVAL ? MICROSECOND`, at
/// most a thousand years (past it a DATETIME overflows).
fn micros(duration: Duration) -> i64 {
    const MAX_MS: u128 = 1000 * 366 * 86_400 * 1000;
    (duration.as_millis().min(MAX_MS) * 1000) as i64
}

/// Refuses a scope or key longer than the table keeps, naming the limit.
fn check_lengths(scope: &str, key: &str) -> Result<(), StoreError> {
    if scope.len() > MAX_SCOPE {
        return Err(StoreError::new(format!(
            "the MySQL store keeps scopes of at most {MAX_SCOPE} bytes; this one is {}",
            scope.len()
        )));
    }
    if key.len() > MAX_KEY {
        return Err(StoreError::new(format!(
            "the MySQL store keeps keys of at most {MAX_KEY} bytes; this one is {}",
            key.len()
        )));
    }
    Ok(())
}

impl Outcomes for MySqlStore {
    type Tx = Transaction<'static, MySql>;

    const MAX_KEY_LEN: usize = MAX_KEY;

    async fn try_claim(&self, claim: &Claim<'_>) -> Result<Option<Claimed>, StoreError> {
        check_lengths(claim.scope, claim.key)?;
        self.claim(claim).await
    }

    async fn read(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(concat!(
            "SELECT fingerprint, identity, status, CAST(response_status AS SIGNED) AS response_status,
                    response_headers, response_body, ",
            left_ms!("locked_until"),
            " AS lease_left
             FROM safe_retry_outcomes WHERE scope = ? AND `key` = ?"
        ))
        .bind(scope.as_bytes())
        .bind(key.as_bytes())
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
                 response_status = ?, response_headers = ?, response_body = ?
             WHERE id = ? AND attempt = ? AND status = 'in_progress'",
        )
        .bind(i32::from(answer.status.as_u16()))
        .bind(encode_headers(&answer.headers))
        .bind(answer.body.as_deref())
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&mut *tx)
        .await?;
        end_fenced(tx, done.rows_affected()).await
    }

    async fn release(&self, tx: Option<Self::Tx>, fence: Fence) -> Result<bool, StoreError> {
        if let Some(tx) = tx {
            tx.rollback().await?;
        }
        let done = sqlx::query(
            "DELETE FROM safe_retry_outcomes WHERE id = ? AND attempt = ? AND status = 'in_progress'",
        )
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn abandon(&self, fence: Fence) -> Result<bool, StoreError> {
        // The connection reports rows matched, not rows changed: a lease already at `now`
        // still counts.
        let done = sqlx::query(concat!(
            "UPDATE safe_retry_outcomes SET locked_until = ",
            now!(),
            " WHERE id = ? AND attempt = ? AND status = 'in_progress'"
        ))
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        // Rows are chosen with SKIP LOCKED (a sweep never waits for a claim or a holder) and
        // deleted by id, under the locks the choice took.
        let mut tx = self.pool.begin().await?;
        let records: Vec<i64> = sqlx::query_scalar(concat!(
            "SELECT id FROM safe_retry_outcomes
             WHERE expires_at <= ",
            now!(),
            "
               AND (status <> 'in_progress' OR (locked_until <= ",
            now!(),
            " AND step IS NULL))
             ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
        ))
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
        let mut deleted = 0;
        if !records.is_empty() {
            let mut delete =
                sqlx::QueryBuilder::<MySql>::new("DELETE FROM safe_retry_outcomes WHERE id IN (");
            let mut list = delete.separated(", ");
            for id in records {
                list.push_bind(id);
            }
            delete.push(")");
            deleted += delete.build().execute(&mut *tx).await?.rows_affected();
        }
        tx.commit().await?;
        let mut tx = self.pool.begin().await?;
        let messages: Vec<Vec<u8>> = sqlx::query_scalar(concat!(
            "SELECT id FROM safe_retry_outbox WHERE expires_at <= ",
            now!(),
            "
             ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
        ))
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
        if !messages.is_empty() {
            let mut delete =
                sqlx::QueryBuilder::<MySql>::new("DELETE FROM safe_retry_outbox WHERE id IN (");
            let mut list = delete.separated(", ");
            for id in messages {
                list.push_bind(id);
            }
            delete.push(")");
            deleted += delete.build().execute(&mut *tx).await?.rows_affected();
        }
        tx.commit().await?;
        Ok(deleted)
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
                 response_status = ?, response_headers = ?, response_body = ?,
                 expires_at = ",
            later!(),
            " WHERE id = ? AND attempt = ? AND status = 'in_progress'"
        ))
        .bind(i32::from(answer.status.as_u16()))
        .bind(encode_headers(&answer.headers))
        .bind(answer.body.as_deref())
        .bind(micros(retention))
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&self.pool)
        .await?;
        Ok(if done.rows_affected() == 0 {
            Completion::Fenced
        } else {
            Completion::Completed
        })
    }
}

impl RecoveryPoints for MySqlStore {
    async fn progress(&self, fence: Fence) -> Result<Progress, StoreError> {
        let row = sqlx::query("SELECT steps, request FROM safe_retry_outcomes WHERE id = ?")
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
             SET step = ?, steps = COALESCE(?, steps), request = COALESCE(request, ?),
                 locked_until = ",
            later!(),
            " WHERE id = ? AND attempt = ? AND status = 'in_progress'"
        ))
        .bind(write.point)
        .bind(write.steps)
        .bind(write.request)
        .bind(micros(write.lease))
        .bind(fence.id)
        .bind(fence.attempt)
        .execute(&mut *tx)
        .await?;
        end_fenced(tx, done.rows_affected()).await
    }

    async fn stalled(&self, batch: u32) -> Result<Vec<Stalled>, StoreError> {
        let rows = sqlx::query(concat!(
            "SELECT CONVERT(scope USING utf8mb4) AS scope, CONVERT(`key` USING utf8mb4) AS `key`,
                    fingerprint
             FROM safe_retry_outcomes
             WHERE status = 'in_progress' AND request IS NOT NULL AND locked_until <= ",
            now!(),
            " ORDER BY locked_until LIMIT ?"
        ))
        .bind(i64::from(batch))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(stalled_of).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_become_microseconds_of_whole_milliseconds_capped_at_a_thousand_years() {
        assert_eq!(micros(Duration::from_millis(1500)), 1_500_000);
        assert_eq!(micros(Duration::from_micros(2_999)), 2_000);
        assert_eq!(micros(Duration::MAX), 1000 * 366 * 86_400 * 1000 * 1000);
    }

    #[test]
    fn a_scope_or_key_past_the_index_is_refused_naming_the_limit() {
        assert!(check_lengths(&"s".repeat(1000), &"k".repeat(2000)).is_ok());
        let scope = check_lengths(&"s".repeat(1001), "k").unwrap_err();
        assert!(
            scope
                .to_string()
                .contains("scopes of at most 1000 bytes; this one is 1001")
        );
        let key = check_lengths("s", &"k".repeat(2001)).unwrap_err();
        assert!(
            key.to_string()
                .contains("keys of at most 2000 bytes; this one is 2001")
        );
    }
}
