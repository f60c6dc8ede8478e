//! The stores under test, each on a real database of its own, and the service they serve.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing;
use axum::{Extension, Json};
use safe_retry_server::store::Outcomes;
use safe_retry_server::{Execution, IdempotencyLayer, Rejected, StoreError};
use tokio::sync::Semaphore;

pub use crate::charges_app::ChargesDb;

/// A store on a database of its own, with the hooks the tests need to move time.
pub trait Backend: ChargesDb {
    /// A new, empty database (a file, or a PostgreSQL schema) with the outcome and effects
    /// tables.
    fn fresh() -> impl Future<Output = Self> + Send;

    /// Ends the lease of every record of `key` now, as if the lease's time had passed.
    fn end_lease(&self, key: &str) -> impl Future<Output = ()> + Send;

    /// Ends the retention of every record of `key` (all records when `None`).
    fn end_retention(&self, key: Option<&str>) -> impl Future<Output = ()> + Send;

    /// The rows of the outcome table: (key, status, attempt).
    fn outcomes(&self) -> impl Future<Output = Vec<(String, String, i64)>> + Send;

    /// A transaction that holds every write to the outcome table back until it ends.
    fn hold_writes(&self) -> impl Future<Output = Self::Tx> + Send;

    /// Drops the outcome table from under the layer: its next statement fails.
    fn break_outcomes(&self) -> impl Future<Output = ()> + Send;

    /// The saved request of `key`'s record, as stored.
    fn saved_request(&self, key: &str) -> impl Future<Output = Option<Vec<u8>>> + Send;

    /// Drops the outbox table from under the relay: its next statement fails.
    fn break_outbox(&self) -> impl Future<Output = ()> + Send;

    /// Overwrites the saved request of `key`'s record with bytes that do not decode.
    fn garble_request(&self, key: &str) -> impl Future<Output = ()> + Send;

    /// The last recovery point of `key`'s record.
    fn point_of(&self, key: &str) -> impl Future<Output = Option<String>> + Send;

    /// Whether the store locks rows (PostgreSQL) rather than the whole database (SQLite).
    const ROW_LOCKS: bool;

    /// What [`stall`](Backend::stall) holds; dropping it ends the stall.
    type Stall: Send;

    /// A new database whose store waits for it at most about 300 ms: SQLite's busy timeout,
    /// PostgreSQL's pool (3 connections) and its acquire timeout.
    fn fresh_impatient() -> impl Future<Output = Self> + Send;

    /// Stalls the store as a payments team meets it: SQLite's writer held by another
    /// connection, PostgreSQL's pool taken whole.
    fn stall(&self) -> impl Future<Output = Self::Stall> + Send;

    /// Holds the row of `key`'s record locked, as a holder frozen between its write and its
    /// commit does (SQLite: the database's writer).
    fn lock_row(&self, key: &str) -> impl Future<Output = Self::Tx> + Send;

    /// A store on the database at `url`, as another server opens it (migrations applied).
    fn connect_to(url: &str) -> impl Future<Output = Self> + Send;

    /// Sets `key`'s record back to in progress, its lease over, as a frozen holder's is.
    fn reopen(&self, key: &str) -> impl Future<Output = ()> + Send;

    /// The database's URL for another process, and a schema (or file) with no tables yet.
    fn empty_database() -> impl Future<Output = String> + Send;

    /// Commits a transaction the store began (the outbox-to-broker tests stage with it).
    #[cfg_attr(not(all(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
    fn commit(tx: Self::Tx) -> impl Future<Output = ()> + Send;
}

static NEXT: AtomicU64 = AtomicU64::new(0);

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use safe_retry_server::SqliteStore;

    /// A new database file's path.
    fn new_file() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join("safe-retry-server-tests");
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        dir.join(format!("{}.db", unique("t")))
    }

    impl Backend for SqliteStore {
        async fn commit(tx: Self::Tx) {
            tx.commit().await.expect("the transaction commits");
        }

        async fn fresh() -> SqliteStore {
            let path = new_file();
            let store = SqliteStore::open(&format!("sqlite://{}", path.display()))
                .await
                .expect("SQLite opens a new file");
            store.prepare().await.expect("the effects table");
            store
        }

        async fn end_lease(&self, key: &str) {
            sqlx::query("UPDATE safe_retry_outcomes SET locked_until = 0 WHERE key = ?1")
                .bind(key)
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn end_retention(&self, key: Option<&str>) {
            sqlx::query(
                "UPDATE safe_retry_outcomes SET expires_at = 0 WHERE ?1 IS NULL OR key = ?1",
            )
            .bind(key)
            .execute(self.pool())
            .await
            .unwrap();
        }

        async fn outcomes(&self) -> Vec<(String, String, i64)> {
            sqlx::query_as("SELECT key, status, attempt FROM safe_retry_outcomes ORDER BY id")
                .fetch_all(self.pool())
                .await
                .unwrap()
        }

        async fn hold_writes(&self) -> Self::Tx {
            // BEGIN IMMEDIATE takes SQLite's one write lock.
            self.begin().await.unwrap()
        }

        async fn break_outcomes(&self) {
            sqlx::query("DROP TABLE safe_retry_outcomes")
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn saved_request(&self, key: &str) -> Option<Vec<u8>> {
            sqlx::query_scalar("SELECT request FROM safe_retry_outcomes WHERE key = ?1")
                .bind(key)
                .fetch_optional(self.pool())
                .await
                .unwrap()
                .flatten()
        }

        async fn break_outbox(&self) {
            sqlx::query("DROP TABLE safe_retry_outbox")
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn garble_request(&self, key: &str) {
            sqlx::query("UPDATE safe_retry_outcomes SET request = X'0001' WHERE key = ?1")
                .bind(key)
                .execute(self.pool())
                .await
                .unwrap();
        }

        const ROW_LOCKS: bool = false;
        type Stall = Self::Tx;

        async fn fresh_impatient() -> SqliteStore {
            let path = new_file();
            let store = SqliteStore::builder(&format!("sqlite://{}", path.display()))
                .busy_timeout(Duration::from_millis(300))
                .open()
                .await
                .expect("SQLite opens a new file");
            store.prepare().await.expect("the effects table");
            store
        }

        async fn stall(&self) -> Self::Tx {
            self.hold_writes().await
        }

        async fn lock_row(&self, _key: &str) -> Self::Tx {
            self.hold_writes().await
        }

        async fn empty_database() -> String {
            format!("sqlite://{}", new_file().display())
        }

        async fn connect_to(url: &str) -> SqliteStore {
            SqliteStore::open(url).await.expect("SQLite opens the file")
        }

        async fn reopen(&self, key: &str) {
            sqlx::query(
                "UPDATE safe_retry_outcomes SET status = 'in_progress', locked_until = 0,
                 response_status = NULL WHERE key = ?1",
            )
            .bind(key)
            .execute(self.pool())
            .await
            .unwrap();
        }

        async fn point_of(&self, key: &str) -> Option<String> {
            sqlx::query_scalar("SELECT step FROM safe_retry_outcomes WHERE key = ?1")
                .bind(key)
                .fetch_optional(self.pool())
                .await
                .unwrap()
                .flatten()
        }
    }
}

#[cfg(feature = "postgres")]
pub mod postgres {
    use super::*;
    use safe_retry_server::PostgresStore;
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use std::str::FromStr;

    /// Where the PostgreSQL tests connect: `SAFE_RETRY_POSTGRES_URL`, or the project machines'
    /// server.
    pub fn url() -> String {
        std::env::var("SAFE_RETRY_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
    }

    /// The URL of a new schema of this run's own (made, and dropped when the run has ended, as
    /// every test's is), for a process of the example to open.
    pub async fn fresh_url() -> String {
        let store = PostgresStore::fresh().await;
        let schema: String = sqlx::query_scalar("SELECT current_schema()::TEXT")
            .fetch_one(store.pool())
            .await
            .unwrap();
        let url = url();
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}options=-csearch_path%3D{schema}")
    }

    /// Drops the schemas that test processes no longer running left behind, once a process.
    async fn drop_schemas_of_ended_runs(admin: &sqlx::PgPool) {
        static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if DONE.swap(true, Ordering::Relaxed) {
            return;
        }
        let schemas: Vec<String> = sqlx::query_scalar(
            "SELECT nspname::TEXT FROM pg_namespace WHERE nspname LIKE 'srs\\_test\\_%'",
        )
        .fetch_all(admin)
        .await
        .unwrap();
        for schema in schemas {
            let pid = schema.split('_').nth(2).unwrap_or_default();
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE"
                )))
                .execute(admin)
                .await;
            }
        }
    }

    /// Cuts every connection of this store's pool on the server's side, as a restart or a
    /// failover does.
    pub async fn cut_connections(store: &PostgresStore) {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE pid <> pg_backend_pid() AND application_name = current_setting('application_name')",
        )
        .execute(store.pool())
        .await
        .unwrap();
    }

    /// How long the first connection of a test may take before the server counts as absent:
    /// a server on loopback answers in milliseconds; without one, each test fails within this
    /// (sqlx's own default, 30 s, made the 55 PostgreSQL tests wait that long each).
    const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

    /// Why PostgreSQL was found unreachable, once a test of this process found it so: the
    /// tests after it fail at once, with the same message.
    static UNREACHABLE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

    /// A new, empty schema of its own, and the options that reach it.
    async fn new_schema() -> (String, PgConnectOptions) {
        let url = url();
        let schema = unique("srs_test");
        if let Some(message) = UNREACHABLE.get() {
            panic!("{message}");
        }
        let unreachable = |error: &dyn std::fmt::Display| -> ! {
            let message = UNREACHABLE.get_or_init(|| {
                format!(
                    "PostgreSQL is unreachable at {url}: {error}. The PostgreSQL tests need a server: \
                     the project's machines run one on 127.0.0.1:5432 (trust auth, database `test`); \
                     elsewhere start one (e.g. `docker run -p 5432:5432 -e POSTGRES_HOST_AUTH_METHOD=trust postgres`) \
                     and set SAFE_RETRY_POSTGRES_URL=postgres://user@host:port/database"
                )
            });
            panic!("{message}")
        };
        let options = PgConnectOptions::from_str(&url).unwrap_or_else(|e| unreachable(&e));
        let connecting = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(CONNECT_TIMEOUT)
            .connect_with(options.clone());
        let admin = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(admin)) => admin,
            Ok(Err(e)) => unreachable(&e),
            Err(_) => unreachable(&format_args!("no connection within {CONNECT_TIMEOUT:?}")),
        };
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
        drop_schemas_of_ended_runs(&admin).await;
        admin.close().await;
        let options = options
            .options([("search_path", schema.as_str())])
            .application_name(&schema);
        (schema, options)
    }

    impl Backend for PostgresStore {
        const ROW_LOCKS: bool = true;
        type Stall = Vec<sqlx::pool::PoolConnection<sqlx::Postgres>>;

        async fn fresh_impatient() -> PostgresStore {
            let (_, options) = new_schema().await;
            let pool = PgPoolOptions::new()
                .max_connections(3)
                .acquire_timeout(Duration::from_millis(300))
                .connect_with(options)
                .await
                .expect("the test schema's pool");
            let store = PostgresStore::from_pool(pool);
            store.migrate().await.expect("the migrations apply");
            store.prepare().await.expect("the effects table");
            store
        }

        async fn stall(&self) -> Self::Stall {
            let mut held = Vec::new();
            for _ in 0..self.pool().options().get_max_connections() {
                held.push(self.pool().acquire().await.expect("a connection"));
            }
            held
        }

        async fn lock_row(&self, key: &str) -> Self::Tx {
            let mut tx = self.begin().await.unwrap();
            sqlx::query("SELECT 1 FROM safe_retry_outcomes WHERE key = $1 FOR UPDATE")
                .bind(key)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        }

        async fn connect_to(url: &str) -> PostgresStore {
            PostgresStore::connect(url)
                .await
                .expect("PostgreSQL connects")
        }

        async fn reopen(&self, key: &str) {
            sqlx::query(
                "UPDATE safe_retry_outcomes SET status = 'in_progress',
                 locked_until = now() - interval '1 second', response_status = NULL WHERE key = $1",
            )
            .bind(key)
            .execute(self.pool())
            .await
            .unwrap();
        }

        async fn empty_database() -> String {
            let (schema, _) = new_schema().await;
            let url = url();
            let separator = if url.contains('?') { '&' } else { '?' };
            format!("{url}{separator}options=-csearch_path%3D{schema}")
        }

        async fn commit(tx: Self::Tx) {
            tx.commit().await.expect("the transaction commits");
        }

        async fn fresh() -> PostgresStore {
            let (_, options) = new_schema().await;
            let pool = PgPoolOptions::new()
                .max_connections(40)
                .connect_with(options)
                .await
                .expect("the test schema's pool");
            let store = PostgresStore::from_pool(pool);
            store.migrate().await.expect("the migrations apply");
            store.prepare().await.expect("the effects table");
            store
        }

        async fn end_lease(&self, key: &str) {
            sqlx::query("UPDATE safe_retry_outcomes SET locked_until = now() - interval '1 second' WHERE key = $1")
                .bind(key)
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn end_retention(&self, key: Option<&str>) {
            sqlx::query(
                "UPDATE safe_retry_outcomes SET expires_at = now() - interval '1 second'
                 WHERE $1::TEXT IS NULL OR key = $1",
            )
            .bind(key)
            .execute(self.pool())
            .await
            .unwrap();
        }

        async fn outcomes(&self) -> Vec<(String, String, i64)> {
            sqlx::query_as("SELECT key, status, attempt FROM safe_retry_outcomes ORDER BY id")
                .fetch_all(self.pool())
                .await
                .unwrap()
        }

        async fn hold_writes(&self) -> Self::Tx {
            let mut tx = self.begin().await.unwrap();
            sqlx::query("LOCK TABLE safe_retry_outcomes IN EXCLUSIVE MODE")
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        }

        async fn break_outcomes(&self) {
            sqlx::query("DROP TABLE safe_retry_outcomes")
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn saved_request(&self, key: &str) -> Option<Vec<u8>> {
            sqlx::query_scalar("SELECT request FROM safe_retry_outcomes WHERE key = $1")
                .bind(key)
                .fetch_optional(self.pool())
                .await
                .unwrap()
                .flatten()
        }

        async fn break_outbox(&self) {
            sqlx::query("DROP TABLE safe_retry_outbox")
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn garble_request(&self, key: &str) {
            sqlx::query("UPDATE safe_retry_outcomes SET request = '\\x0001'::BYTEA WHERE key = $1")
                .bind(key)
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn point_of(&self, key: &str) -> Option<String> {
            sqlx::query_scalar("SELECT step FROM safe_retry_outcomes WHERE key = $1")
                .bind(key)
                .fetch_optional(self.pool())
                .await
                .unwrap()
                .flatten()
        }
    }
}

#[cfg(feature = "mysql")]
pub mod mysql {
    use super::*;
    use safe_retry_server::MySqlStore;
    use sqlx::mysql::MySqlConnectOptions;
    use std::str::FromStr;

    /// Where the MySQL tests connect: `SAFE_RETRY_MYSQL_URL`, or the project machines'
    /// MariaDB.
    pub fn url() -> String {
        std::env::var("SAFE_RETRY_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
    }

    /// How long the first connection of a test may take before the server counts as absent.
    const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

    /// Why MySQL was found unreachable, once a test of this process found it so.
    static UNREACHABLE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

    /// A new, empty database of this run's own (dropped by a later run once this one has
    /// ended), and its URL.
    pub async fn fresh_url() -> String {
        let url = url();
        if let Some(message) = UNREACHABLE.get() {
            panic!("{message}");
        }
        let unreachable = |error: &dyn std::fmt::Display| -> ! {
            let message = UNREACHABLE.get_or_init(|| {
                format!(
                    "MySQL is unreachable at {url}: {error}. The MySQL tests need MySQL 8 or MariaDB 10.11+: \
                     the project's machines run MariaDB on 127.0.0.1:3306 (user root, no password); \
                     elsewhere start one (e.g. `docker run -p 3306:3306 -e MARIADB_ALLOW_EMPTY_ROOT_PASSWORD=1 mariadb:11`) \
                     and set SAFE_RETRY_MYSQL_URL=mysql://user:password@host:port/database"
                )
            });
            panic!("{message}")
        };
        let options = MySqlConnectOptions::from_str(&url).unwrap_or_else(|e| unreachable(&e));
        let connecting = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(CONNECT_TIMEOUT)
            .connect_with(options.clone());
        let admin = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(admin)) => admin,
            Ok(Err(e)) => unreachable(&e),
            Err(_) => unreachable(&format_args!("no connection within {CONNECT_TIMEOUT:?}")),
        };
        let database = unique("srs_test");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await
            .unwrap();
        drop_databases_of_ended_runs(&admin).await;
        admin.close().await;
        let base = url.split('?').next().unwrap_or(&url);
        let base = base.rsplit_once('/').map_or(base, |(head, _)| head);
        format!("{base}/{database}")
    }

    /// Drops the databases that test processes no longer running left behind, once a process.
    async fn drop_databases_of_ended_runs(admin: &sqlx::MySqlPool) {
        static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if DONE.swap(true, Ordering::Relaxed) {
            return;
        }
        let databases: Vec<String> = sqlx::query_scalar(
            "SELECT CONVERT(schema_name USING utf8mb4) FROM information_schema.schemata
             WHERE schema_name LIKE 'srs\\_test\\_%'",
        )
        .fetch_all(admin)
        .await
        .unwrap();
        for database in databases {
            let pid = database.split('_').nth(2).unwrap_or_default();
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {database}"
                )))
                .execute(admin)
                .await;
            }
        }
    }

    /// Cuts every connection of this store's pool on the server's side (`KILL`), as a restart
    /// or a failover does.
    pub async fn cut_connections(store: &MySqlStore) {
        let mut own = store.pool().acquire().await.unwrap();
        let others: Vec<i64> = sqlx::query_scalar(
            "SELECT CAST(id AS SIGNED) FROM information_schema.processlist
             WHERE db = DATABASE() AND id <> CONNECTION_ID()",
        )
        .fetch_all(&mut *own)
        .await
        .unwrap();
        for id in others {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!("KILL {id}")))
                .execute(&mut *own)
                .await;
        }
    }

    /// A store on a new database, its pool as given.
    async fn on_new_database(connections: u32, acquire: Duration) -> MySqlStore {
        let url = fresh_url().await;
        let store = MySqlStore::builder(&url)
            .max_connections(connections)
            .acquire_timeout(acquire)
            .lock_wait_timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("the test database's store");
        store.prepare().await.expect("the effects table");
        store
    }

    impl Backend for MySqlStore {
        const ROW_LOCKS: bool = true;
        type Stall = Vec<sqlx::pool::PoolConnection<sqlx::MySql>>;

        async fn fresh() -> MySqlStore {
            on_new_database(40, Duration::from_secs(5)).await
        }

        async fn fresh_impatient() -> MySqlStore {
            on_new_database(3, Duration::from_millis(300)).await
        }

        async fn stall(&self) -> Self::Stall {
            let mut held = Vec::new();
            for _ in 0..self.pool().options().get_max_connections() {
                held.push(self.pool().acquire().await.expect("a connection"));
            }
            held
        }

        async fn lock_row(&self, key: &str) -> Self::Tx {
            let mut tx = self.begin().await.unwrap();
            sqlx::query("SELECT 1 FROM safe_retry_outcomes WHERE `key` = ? FOR UPDATE")
                .bind(key.as_bytes())
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        }

        async fn connect_to(url: &str) -> MySqlStore {
            MySqlStore::connect(url).await.expect("MySQL connects")
        }

        async fn reopen(&self, key: &str) {
            sqlx::query(
                "UPDATE safe_retry_outcomes SET status = 'in_progress',
                 locked_until = UTC_TIMESTAMP(3) - INTERVAL 1 SECOND, response_status = NULL
                 WHERE `key` = ?",
            )
            .bind(key.as_bytes())
            .execute(self.pool())
            .await
            .unwrap();
        }

        async fn empty_database() -> String {
            fresh_url().await
        }

        async fn commit(tx: Self::Tx) {
            tx.commit().await.expect("the transaction commits");
        }

        async fn end_lease(&self, key: &str) {
            sqlx::query(
                "UPDATE safe_retry_outcomes SET locked_until = UTC_TIMESTAMP(3) - INTERVAL 1 SECOND
                 WHERE `key` = ?",
            )
            .bind(key.as_bytes())
            .execute(self.pool())
            .await
            .unwrap();
        }

        async fn end_retention(&self, key: Option<&str>) {
            sqlx::query(
                "UPDATE safe_retry_outcomes SET expires_at = UTC_TIMESTAMP(3) - INTERVAL 1 SECOND
                 WHERE ? IS NULL OR `key` = ?",
            )
            .bind(key.map(str::as_bytes))
            .bind(key.map(str::as_bytes))
            .execute(self.pool())
            .await
            .unwrap();
        }

        async fn outcomes(&self) -> Vec<(String, String, i64)> {
            sqlx::query_as(
                "SELECT CONVERT(`key` USING utf8mb4), status, attempt FROM safe_retry_outcomes
                 ORDER BY id",
            )
            .fetch_all(self.pool())
            .await
            .unwrap()
        }

        async fn hold_writes(&self) -> Self::Tx {
            // Every row locked, and (at REPEATABLE READ) the gaps between and after them: no
            // insert or update gets past.
            let mut tx = self
                .pool()
                .begin_with("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; START TRANSACTION")
                .await
                .unwrap();
            sqlx::query("SELECT id FROM safe_retry_outcomes FOR UPDATE")
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        }

        async fn break_outcomes(&self) {
            sqlx::query("DROP TABLE safe_retry_outcomes")
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn saved_request(&self, key: &str) -> Option<Vec<u8>> {
            sqlx::query_scalar("SELECT request FROM safe_retry_outcomes WHERE `key` = ?")
                .bind(key.as_bytes())
                .fetch_optional(self.pool())
                .await
                .unwrap()
                .flatten()
        }

        async fn break_outbox(&self) {
            sqlx::query("DROP TABLE safe_retry_outbox")
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn garble_request(&self, key: &str) {
            sqlx::query("UPDATE safe_retry_outcomes SET request = X'0001' WHERE `key` = ?")
                .bind(key.as_bytes())
                .execute(self.pool())
                .await
                .unwrap();
        }

        async fn point_of(&self, key: &str) -> Option<String> {
            sqlx::query_scalar("SELECT step FROM safe_retry_outcomes WHERE `key` = ?")
                .bind(key.as_bytes())
                .fetch_optional(self.pool())
                .await
                .unwrap()
                .flatten()
        }
    }
}

/// What the test service's handlers do, set per test.
#[derive(Clone)]
pub struct Script {
    /// Held by each charge before it writes its effect: a test holds permits back to stall it.
    pub gate: Arc<Semaphore>,
    /// Held by each charge after it wrote its effect, before it answers.
    pub after: Arc<Semaphore>,
    /// Tells the test a charge has begun (one permit per charge).
    pub began: Arc<Semaphore>,
    /// Tells the test a charge has written its effect (one permit per charge).
    pub wrote: Arc<Semaphore>,
    /// Calls of `/plain`.
    pub plain_calls: Arc<std::sync::atomic::AtomicUsize>,
}

impl Default for Script {
    fn default() -> Self {
        let open = || Arc::new(Semaphore::new(Semaphore::MAX_PERMITS));
        Script {
            gate: open(),
            after: open(),
            began: Arc::new(Semaphore::new(0)),
            wrote: Arc::new(Semaphore::new(0)),
            plain_calls: Arc::default(),
        }
    }
}

impl Script {
    /// A script whose charges wait before their effect until the test adds permits to the gate.
    pub fn stalled() -> Script {
        Script {
            gate: Arc::new(Semaphore::new(0)),
            ..Script::default()
        }
    }

    /// A script whose charges wait after their effect, holding their transaction, until the
    /// test adds permits.
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub fn stalled_after() -> Script {
        Script {
            after: Arc::new(Semaphore::new(0)),
            ..Script::default()
        }
    }
}

/// The service under test: the example's routes plus
/// - `POST /script`: a charge that waits at the script's gate (its first attempt only; a
///   takeover does not), writes its effect, waits at the `after` gate, and answers `201` with
///   headers of its own;
/// - `POST /validated`: refuses a body containing "bad" before doing anything (marked
///   [`Rejected`]), otherwise writes its effect;
/// - `POST /fails`: writes its effect, then answers `500` with a body of its own;
/// - `POST /plain`: counts its calls, and answers whether the layer gave it an execution.
pub fn service<S: Backend>(layer: IdempotencyLayer<S>, script: Script) -> Router {
    let scripted = Router::new()
        .route("/script", routing::post(scripted::<S>))
        .route("/validated", routing::post(validated::<S>))
        .route("/fails", routing::post(fails::<S>))
        .route("/plain", routing::post(plain::<S>))
        .layer(layer.clone())
        .with_state(script);
    crate::charges_app::app(layer, Duration::ZERO).merge(scripted)
}

/// Writes the effect in the handler's transaction; a store that fails is answered with the
/// crate's own answers, as a user's handler does.
async fn write_effect<S: Backend>(execution: &Execution<S>, body: &str) -> Result<i64, Response> {
    let mut tx = execution
        .local()
        .await
        .map_err(IntoResponse::into_response)?;
    S::record_effect(&mut tx, execution.key(), body)
        .await
        .map_err(|e| StoreError::from(e).into_response())
}

async fn scripted<S: Backend>(
    State(script): State<Script>,
    Extension(execution): Extension<Execution<S>>,
    body: String,
) -> Response {
    script.began.add_permits(1);
    if execution.attempt() == 1 {
        script
            .gate
            .acquire()
            .await
            .expect("the gate stays open")
            .forget();
    }
    let written = write_effect(&execution, &body).await;
    script.wrote.add_permits(1);
    script
        .after
        .acquire()
        .await
        .expect("the gate stays open")
        .forget();
    match written {
        Ok(id) => {
            let mut headers = HeaderMap::new();
            headers.insert("x-effect", id.into());
            headers.append("set-cookie", "a=1".parse().unwrap());
            headers.append("set-cookie", "b=2".parse().unwrap());
            (
                StatusCode::CREATED,
                headers,
                Json(serde_json::json!({
                    "effect_id": id,
                    "attempt": execution.attempt(),
                    "taken_over": execution.taken_over(),
                    "scope": execution.scope(),
                    "execution": format!("{execution:?}"),
                    "local": execution.local().await.map(|local| format!("{local:?}")).ok(),
                })),
            )
                .into_response()
        }
        Err(response) => response,
    }
}

async fn validated<S: Backend>(
    Extension(execution): Extension<Execution<S>>,
    body: String,
) -> Response {
    if body.contains("bad") {
        let mut response =
            (StatusCode::UNPROCESSABLE_ENTITY, "amount must be positive").into_response();
        response.extensions_mut().insert(Rejected);
        return response;
    }
    match write_effect(&execution, &body).await {
        Ok(id) => (StatusCode::CREATED, format!("effect {id}")).into_response(),
        Err(response) => response,
    }
}

async fn plain<S: Backend>(
    State(script): State<Script>,
    execution: Option<Extension<Execution<S>>>,
) -> String {
    script.plain_calls.fetch_add(1, Ordering::Relaxed);
    match execution {
        Some(_) => "an execution".into(),
        None => "no execution".into(),
    }
}

async fn fails<S: Backend>(
    Extension(execution): Extension<Execution<S>>,
    body: String,
) -> Response {
    match write_effect(&execution, &body).await {
        Ok(id) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the card network failed after effect {id}"),
        )
            .into_response(),
        Err(response) => response,
    }
}

/// A service on loopback: its address and the task serving it.
pub struct Running {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    pub async fn start(router: Router) -> Running {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        Running { addr, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An answer as the tests compare them: status, headers but `date`, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub async fn of(response: reqwest::Response) -> Answer {
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .filter(|(n, _)| *n != "date")
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        let body = response.bytes().await.unwrap().to_vec();
        Answer {
            status,
            headers,
            body,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| std::str::from_utf8(v).unwrap())
    }

    /// The same answer without the replay marker.
    pub fn unmarked(&self) -> Answer {
        Answer {
            headers: self
                .headers
                .iter()
                .filter(|(n, _)| n != "idempotent-replayed")
                .cloned()
                .collect(),
            ..self.clone()
        }
    }

    pub fn problem_type(&self) -> String {
        let json: serde_json::Value =
            serde_json::from_slice(&self.body).expect("a problem+json body");
        json["type"].as_str().unwrap().to_owned()
    }
}

/// Runs `work` to its end on a runtime of this thread alone, so that a thread-local recorder or
/// subscriber sees everything it does, spawned tasks included.
pub fn on_this_thread<F: Future>(work: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
        .block_on(work)
}

/// Sends a POST with a key (none when `key` is `None`).
pub async fn post(client: &reqwest::Client, url: &str, key: Option<&str>, body: &str) -> Answer {
    let mut request = client.post(url).body(body.to_owned());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    Answer::of(request.send().await.expect("the service answers")).await
}
