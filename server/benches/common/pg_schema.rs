//! A schema of a bench's own on PostgreSQL: the PostgreSQL benches share it (the recovery
//! bench includes this file alone, without the rest of `common`).

/// A schema of a bench's own on PostgreSQL (`SAFE_RETRY_POSTGRES_URL`
/// [postgres://postgres@127.0.0.1:5432/test]), with the pool of 16 on it that the benches'
/// stores use; [`PgSchema::drop`] removes it.
pub struct PgSchema {
    admin: sqlx::PgPool,
    name: String,
    /// The pool of 16 connections whose search path is the schema.
    pub pool: sqlx::PgPool,
}

impl PgSchema {
    /// Creates `srs_<bench>_<pid>`, or fails saying where PostgreSQL was looked for.
    pub async fn create(bench: &str) -> PgSchema {
        use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
        use std::str::FromStr;
        let url = std::env::var("SAFE_RETRY_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let name = format!("srs_{bench}_{}", std::process::id());
        let options = PgConnectOptions::from_str(&url).unwrap();
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .unwrap_or_else(|e| {
                panic!("PostgreSQL is unreachable at {url}: {e}; set SAFE_RETRY_POSTGRES_URL")
            });
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
            .execute(&admin)
            .await
            .unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(options.options([("search_path", name.as_str())]))
            .await
            .unwrap();
        PgSchema { admin, name, pool }
    }

    /// Closes the pool and drops the schema with everything in it.
    pub async fn drop(self) {
        self.pool.close().await;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.name
        )))
        .execute(&self.admin)
        .await
        .unwrap();
    }
}
