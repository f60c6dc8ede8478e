//! The server half's tests: every rule on every store, through real HTTP and a real database.
//!
//! SQLite needs nothing; the PostgreSQL tests (feature `postgres`, on under
//! `cargo test --all-features`) need a server at `SAFE_RETRY_POSTGRES_URL`
//! [postgres://postgres@127.0.0.1:5432/test] and fail saying so when there is none; the MySQL
//! tests (feature `mysql`) need MySQL 8 or MariaDB 10.11+ at `SAFE_RETRY_MYSQL_URL`
//! [mysql://root@127.0.0.1:3306/test], and fail saying so when there is none. Each test makes
//! a schema (a database, on MySQL) of its own.

/// Runs each named test, generic over its store, once per store.
macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        #[cfg(feature = "sqlite")]
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::SqliteStore>().await
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::PostgresStore>().await
                }
            )*
        }
        #[cfg(feature = "mysql")]
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::MySqlStore>().await
                }
            )*
        }
    };
}

mod auto_traits;
#[cfg(feature = "grpc")]
#[path = "../../examples/support/bank.rs"]
mod bank;
mod both_halves;
#[cfg(all(feature = "rabbitmq", feature = "nats"))]
#[allow(dead_code)]
#[path = "../../examples/support/brokers.rs"]
mod brokers;
#[allow(dead_code)]
#[path = "../../examples/support/charges_app.rs"]
mod charges_app;
mod config;
#[cfg(all(feature = "rabbitmq", feature = "nats"))]
mod consumer;
#[cfg(all(feature = "rabbitmq", feature = "nats", feature = "postgres"))]
mod consumer_chaos;
mod consumer_model;
mod crash;
mod direct;
mod events;
mod first_month;
mod fleet;
#[cfg(feature = "grpc")]
mod grpc;
#[cfg(feature = "grpc")]
#[path = "../../examples/support/grpc_halves.rs"]
mod grpc_halves;
mod layout;
#[path = "../../examples/support/lossy_link.rs"]
mod lossy_link;
mod model;
#[cfg(feature = "operator")]
mod operator;
#[cfg(feature = "operator")]
mod operator_page;
#[allow(dead_code)]
#[path = "../../examples/support/orders_app.rs"]
mod orders_app;
mod pause;
mod processes;
#[allow(dead_code)]
#[path = "../../examples/support/receiver.rs"]
mod receiver;
mod rules;
mod step_model;
mod steps;
mod support;
#[allow(dead_code)]
#[path = "../../examples/support/walkthrough.rs"]
mod walkthrough;
