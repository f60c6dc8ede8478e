//! Configuration the layer refuses, with a message that names the setting and the fix; and the
//! handler's side of the layer as axum extractors.

use std::time::Duration;

use safe_retry_server::{IdempotencyLayer, SqliteStore};

#[tokio::test]
async fn a_configuration_that_breaks_a_promise_fails_at_build_naming_the_fix() {
    let store = SqliteStore::memory().await.unwrap();
    let refused =
        |builder: safe_retry_server::Builder<SqliteStore>| builder.build().unwrap_err().to_string();
    let message = refused(
        IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .methods([]),
    );
    assert!(
        message.contains("`methods` is empty") && message.contains("POST"),
        "{message}"
    );
    let message = refused(
        IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .lease(Duration::ZERO),
    );
    assert!(
        message.contains("`lease`") && message.contains("default 30 s"),
        "{message}"
    );
    let message = refused(
        IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .lease(Duration::from_secs(60))
            .retention(Duration::from_secs(60)),
    );
    assert!(
        message.contains("`retention` (60s) is not longer than `lease` (60s)"),
        "{message}"
    );
    for len in [0, 4097] {
        let message = refused(
            IdempotencyLayer::builder(store.clone())
                .shared_scope()
                .max_key_len(len),
        );
        assert!(
            message.contains(&format!("`max_key_len` is {len}")),
            "{message}"
        );
    }
    // No scope chosen: refused, naming both ways to choose.
    let message = refused(IdempotencyLayer::builder(store.clone()));
    assert!(
        message.contains("no scope chosen")
            && message.contains(".scope(")
            && message.contains(".shared_scope()"),
        "{message}"
    );
    // A saved request never keeps a credential, whatever its header is called.
    for secret in [
        "authorization",
        "proxy-authorization",
        "cookie",
        "x-api-key",
        "x-apikey",
        "x-auth-token",
        "x-session-id",
        "x-client-secret",
        "x-password",
    ] {
        let message = refused(
            IdempotencyLayer::builder(store.clone())
                .shared_scope()
                .saved_headers([http::HeaderName::from_static(secret)]),
        );
        assert!(
            message.contains(&format!("names `{secret}`, a credential")),
            "{secret}: {message}"
        );
    }
    let allowed = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .saved_headers([
            http::HeaderName::from_static("x-trace"),
            http::header::CONTENT_TYPE,
        ])
        .build();
    assert!(allowed.is_ok());
    let message = refused(
        IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .request_body_timeout(Duration::ZERO),
    );
    assert!(
        message.contains("`request_body_timeout` is zero"),
        "{message}"
    );
    // What a layer and its builder show of themselves.
    let builder = IdempotencyLayer::builder(store.clone()).shared_scope();
    assert!(
        format!("{builder:?}").starts_with("Builder { store: SqliteStore"),
        "{builder:?}"
    );
    let layer = builder.build().unwrap();
    let shown = format!("{layer:?}");
    assert!(
        shown.starts_with("IdempotencyLayer { store: SqliteStore"),
        "{shown}"
    );
    assert!(
        shown.contains("methods: [POST, PATCH], key: IdempotencyKey(Either), require_key: true, lease: 30s, retention: 86400s, max_attempts: 10, failed_retention: 604800s"),
        "{shown}"
    );
    let message = refused(
        IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .max_attempts(0),
    );
    assert!(
        message.contains("`max_attempts` is 0") && message.contains("default 10"),
        "{message}"
    );
    let tuned = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .max_attempts(1)
        .failed_retention(Duration::from_secs(5))
        .build()
        .unwrap();
    assert!(
        format!("{tuned:?}").contains("max_attempts: 1, failed_retention: 5s"),
        "{tuned:?}"
    );
    // The edges that are allowed.
    IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .lease(Duration::from_millis(1))
        .retention(Duration::from_millis(2))
        .max_key_len(4096)
        .build()
        .unwrap();
}

/// A store that keeps shorter keys than a layer would take refuses the layer at build, naming
/// its limit (MySQL's unique index over scope and key holds keys of at most 2,000 bytes).
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_layer_taking_longer_keys_than_mysql_keeps_is_refused_at_build() {
    use crate::support::Backend;
    let store = safe_retry_server::MySqlStore::fresh().await;
    let message = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .max_key_len(2001)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("`max_key_len` is 2001, but the store keeps keys of at most 2000 bytes"),
        "{message}"
    );
    IdempotencyLayer::builder(store)
        .shared_scope()
        .max_key_len(2000)
        .build()
        .unwrap();
}

/// Migrating a database that is up to date changes nothing, on each store: servers that start
/// together, or again, all run `migrate`.
async fn migrating_again_changes_nothing<S: crate::support::Backend>(migrate: impl AsyncFn(&S)) {
    let store = S::fresh().await;
    let fingerprint = [1; 32];
    let claim = safe_retry_server::store::Claim {
        scope: "",
        key: "k",
        fingerprint: &fingerprint,
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(60),
    };
    assert!(store.try_claim(&claim).await.unwrap().is_some());
    migrate(&store).await;
    migrate(&store).await;
    assert_eq!(
        store.outcomes().await,
        [("k".to_owned(), "in_progress".to_owned(), 1)]
    );
}

#[tokio::test]
async fn migrating_sqlite_again_changes_nothing() {
    migrating_again_changes_nothing::<SqliteStore>(async |s| s.migrate().await.unwrap()).await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn migrating_mysql_again_changes_nothing() {
    migrating_again_changes_nothing::<safe_retry_server::MySqlStore>(async |s| {
        s.migrate().await.unwrap()
    })
    .await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn migrating_postgres_again_changes_nothing() {
    migrating_again_changes_nothing::<safe_retry_server::PostgresStore>(async |s| {
        s.migrate().await.unwrap()
    })
    .await;
}

#[cfg(feature = "axum")]
mod extractors {
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;
    use safe_retry_server::{Execution, IdempotencyLayer, Local, Rejected};

    use crate::support::{Backend, Running, post as send};

    /// The handler takes its transaction as an extractor and refuses with `Rejected` as a
    /// response part; its effect commits with the stored answer.
    async fn charge<S: Backend>(
        execution: Execution<S>,
        mut tx: Local<S>,
        body: String,
    ) -> Result<(StatusCode, String), (StatusCode, Rejected, &'static str)> {
        if body.is_empty() {
            return Err((StatusCode::BAD_REQUEST, Rejected, "a charge needs a body"));
        }
        let id = S::record_effect(&mut tx, execution.key(), &body)
            .await
            .unwrap();
        Ok((StatusCode::CREATED, format!("effect {id}")))
    }

    async fn local_and_execution_are_extractors_and_rejected_a_response_part<S: Backend>() {
        let store = S::fresh().await;
        let layer = IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .build()
            .unwrap();
        let app = Router::new()
            .route("/charges", post(charge::<S>))
            .layer(layer)
            .merge(
                Router::new().route("/unguarded", post(|_tx: Local<S>| async { "unreachable" })),
            );
        let server = Running::start(app).await;
        let client = reqwest::Client::new();
        let url = server.url("/charges");

        let refused = send(&client, &url, Some("k"), "").await;
        assert_eq!(
            (refused.status, refused.body.as_slice()),
            (400, &b"a charge needs a body"[..])
        );
        assert_eq!(store.outcomes().await, [], "a rejection is not stored");
        let created = send(&client, &url, Some("k"), "amount=1").await;
        assert_eq!(
            (created.status, created.body.as_slice()),
            (201, &b"effect 1"[..])
        );
        let replay = send(&client, &url, Some("k"), "amount=1").await;
        assert_eq!(replay.unmarked(), created);
        assert_eq!(store.effects().await.unwrap().len(), 1);

        // Without the layer, the extractor answers with a problem that says so.
        let missing = send(&client, &server.url("/unguarded"), None, "").await;
        assert_eq!(missing.status, 500);
        let json: serde_json::Value = serde_json::from_slice(&missing.body).unwrap();
        assert!(
            json["detail"]
                .as_str()
                .unwrap()
                .contains("put the layer on this route"),
            "{json}"
        );
        assert_eq!(store.sweep(10).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn on_sqlite() {
        local_and_execution_are_extractors_and_rejected_a_response_part::<
            safe_retry_server::SqliteStore,
        >()
        .await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test]
    async fn on_mysql() {
        local_and_execution_are_extractors_and_rejected_a_response_part::<
            safe_retry_server::MySqlStore,
        >()
        .await;
    }

    #[cfg(feature = "postgres")]
    #[tokio::test]
    async fn on_postgres() {
        local_and_execution_are_extractors_and_rejected_a_response_part::<
            safe_retry_server::PostgresStore,
        >()
        .await;
    }
}

/// With the `metrics` feature every count is a counter of the `metrics` facade: each described
/// and registered at zero when the layer is built, and counted as it happens.
#[cfg(feature = "metrics")]
#[test]
fn the_counters_go_to_the_metrics_facade_described_and_at_zero_from_the_start() {
    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    #[derive(Default)]
    struct Kept {
        described: Mutex<BTreeMap<String, String>>,
        counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
    }
    impl Recorder for Kept {
        fn describe_counter(&self, name: KeyName, _: Option<Unit>, about: SharedString) {
            let mut described = self.described.lock().unwrap();
            described.insert(name.as_str().to_owned(), about.to_string());
        }
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let mut counters = self.counters.lock().unwrap();
            Counter::from_arc(counters.entry(key.name().to_owned()).or_default().clone())
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    let kept = Kept::default();
    let value = |name: &str| kept.counters.lock().unwrap()[name].load(Ordering::Relaxed);
    metrics::with_local_recorder(&kept, || {
        crate::support::on_this_thread(async {
            let store = SqliteStore::memory().await.unwrap();
            let layer = IdempotencyLayer::builder(store)
                .shared_scope()
                .build()
                .unwrap();
            let counters = layer.counters().iter().count();
            assert_eq!(kept.described.lock().unwrap().len(), counters);
            assert_eq!(kept.counters.lock().unwrap().len(), counters);
            assert_eq!(value("safe_retry_server_claims_total"), 0);
            assert!(
                kept.described.lock().unwrap()["safe_retry_server_replays_total"]
                    .contains("sent again")
            );
            let mut router = axum::Router::new()
                .route("/orders", axum::routing::post(|| async { "done" }))
                .layer(layer.clone());
            for _ in 0..2 {
                let request = http::Request::post("/orders")
                    .header("idempotency-key", "k")
                    .body(axum::body::Body::from("x"))
                    .unwrap();
                tower_service::Service::call(&mut router, request)
                    .await
                    .unwrap();
            }
            let snapshot = layer.counters().snapshot();
            assert_eq!((snapshot.claims, snapshot.replays), (1, 1));
        });
    });
    assert_eq!(value("safe_retry_server_claims_total"), 1);
    assert_eq!(value("safe_retry_server_completions_total"), 1);
    assert_eq!(value("safe_retry_server_replays_total"), 1);
    assert_eq!(value("safe_retry_server_in_progress_total"), 0);
}

/// A SQLite database another process holds locked while this one opens it: the opening waits
/// (within the busy timeout) and succeeds once the lock is gone; a database that cannot be
/// opened at all fails at once, not after the busy timeout.
#[tokio::test]
async fn opening_sqlite_waits_out_another_process_s_lock_and_fails_fast_on_the_rest() {
    use std::str::FromStr;
    let dir = std::env::temp_dir().join("safe-retry-server-tests");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!(
        "lock-{}-{:?}.db",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_file(&path);
    let url = format!("sqlite://{}", path.display());
    // Another process's view of the file: a rollback-journal connection holding it exclusively.
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(&url)
        .unwrap()
        .create_if_missing(true);
    let other = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    let mut holder = other.begin_with("BEGIN EXCLUSIVE").await.unwrap();
    sqlx::query("CREATE TABLE held (x INTEGER)")
        .execute(&mut *holder)
        .await
        .unwrap();
    let opening = tokio::spawn({
        let url = url.clone();
        async move {
            SqliteStore::builder(&url)
                .busy_timeout(Duration::from_secs(10))
                .open()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    holder.commit().await.unwrap();
    other.close().await;
    let opened = tokio::time::timeout(Duration::from_secs(10), opening)
        .await
        .expect("the opening ends within its busy timeout")
        .unwrap();
    assert!(opened.is_ok(), "{opened:?}");

    let began = std::time::Instant::now();
    let nowhere = SqliteStore::builder("sqlite:///proc/no-such-dir/x.db")
        .busy_timeout(Duration::from_secs(10))
        .open();
    let nowhere = tokio::time::timeout(Duration::from_secs(8), nowhere)
        .await
        .expect("the opening ends");
    assert!(nowhere.is_err());
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "a database that cannot be opened fails at once, not after the busy timeout: {:?}",
        began.elapsed()
    );
    let _ = std::fs::remove_file(&path);
}

/// The gRPC layer's own settings, refused at `build_grpc` naming the fix; the shared checks
/// hold for it too; and a builder told of gRPC methods never builds an HTTP layer that would
/// leave them unguarded.
#[cfg(feature = "grpc")]
#[tokio::test]
async fn a_grpc_configuration_that_breaks_a_promise_fails_at_build_naming_the_fix() {
    use safe_retry_server::KeySource;
    let store = SqliteStore::memory().await.unwrap();
    let builder = || IdempotencyLayer::builder(store.clone()).shared_scope();
    let refused = |builder: safe_retry_server::Builder<SqliteStore>| {
        builder.build_grpc().unwrap_err().to_string()
    };
    let message = refused(builder());
    assert!(
        message.contains("no gRPC method named") && message.contains(".grpc_method("),
        "{message}"
    );
    for bad in [
        "/bank.Bank",
        "/bank.Bank/Charge/more",
        "//Charge",
        "/bank Bank/Charge",
    ] {
        let message = refused(builder().grpc_method(bad));
        assert!(
            message.contains("is not a gRPC method's path") && message.contains(bad),
            "{bad}: {message}"
        );
    }
    let message = refused(
        builder()
            .grpc_method("/bank.Bank/Charge")
            .key(KeySource::json_pointer("/id")),
    );
    assert!(
        message.contains("reads the body") && message.contains("metadata"),
        "{message}"
    );
    let message = refused(builder().grpc_method("bank.Bank/Charge").max_attempts(0));
    assert!(message.contains("`max_attempts` is 0"), "{message}");
    let message = builder()
        .grpc_method("/bank.Bank/Charge")
        .build()
        .unwrap_err()
        .to_string();
    assert!(message.contains("build_grpc"), "{message}");
    let layer = builder()
        .grpc_method("bank.Bank/Charge")
        .grpc_method_key_optional("/bank.Bank/Refund")
        .build_grpc()
        .unwrap();
    let shown = format!("{layer:?}");
    assert!(
        shown.contains("path: \"/bank.Bank/Charge\", key_required: true")
            && shown.contains("path: \"/bank.Bank/Refund\", key_required: false"),
        "{shown}"
    );
    assert!(
        shown.contains("\"grpc-encoding\", \"grpc-accept-encoding\""),
        "the default list gains gRPC's: {shown}"
    );
    let chosen = builder()
        .grpc_method("bank.Bank/Charge")
        .saved_headers([http::header::CONTENT_TYPE])
        .build_grpc()
        .unwrap();
    let shown = format!("{chosen:?}");
    assert!(
        shown.contains("saved_headers: [\"content-type\"]"),
        "a chosen list is kept: {shown}"
    );
}

/// `MySqlStore::sweep` (no trait in scope) deletes what the retention no longer keeps, in
/// batches, as the trait's does.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn the_mysql_store_sweeps_without_the_trait_in_scope() {
    use crate::support::Backend;
    let store = safe_retry_server::MySqlStore::fresh().await;
    let fingerprint = [3; 32];
    for key in ["a", "b", "c"] {
        let claim = safe_retry_server::store::Claim {
            scope: "",
            key,
            fingerprint: &fingerprint,
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(60),
        };
        let claimed = safe_retry_server::store::Outcomes::try_claim(&store, &claim)
            .await
            .unwrap();
        assert!(claimed.is_some());
        store.end_lease(key).await;
    }
    assert_eq!(store.sweep(10).await.unwrap(), 0, "within their retention");
    store.end_retention(None).await;
    assert_eq!(store.sweep(2).await.unwrap(), 2, "a batch of two");
    assert_eq!(store.sweep(2).await.unwrap(), 1);
    assert_eq!(store.outcomes().await, []);
}

/// The MySQL store's connections run at READ COMMITTED, with its bounded lock wait, in strict
/// mode: those it opens and those of a pool made from `MySqlStore::pool_options`.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn the_mysql_store_s_connections_run_at_read_committed_with_a_bounded_wait() {
    use safe_retry_server::MySqlStore;
    async fn settings(pool: &sqlx::MySqlPool) -> (String, i64, String) {
        // MariaDB before 11.1 names the isolation `tx_isolation`; MySQL 8, `transaction_isolation`.
        let isolation: String = match sqlx::query_scalar("SELECT @@SESSION.tx_isolation")
            .fetch_one(pool)
            .await
        {
            Ok(isolation) => isolation,
            Err(_) => sqlx::query_scalar("SELECT @@SESSION.transaction_isolation")
                .fetch_one(pool)
                .await
                .unwrap(),
        };
        let (wait, mode): (i64, String) = sqlx::query_as(
            "SELECT CAST(@@SESSION.innodb_lock_wait_timeout AS SIGNED), @@SESSION.sql_mode",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        (isolation, wait, mode)
    }
    let url = crate::support::mysql::fresh_url().await;
    let store = MySqlStore::builder(&url)
        .lock_wait_timeout(Duration::from_secs(3))
        .connect()
        .await
        .unwrap();
    let (isolation, wait, mode) = settings(store.pool()).await;
    assert_eq!((isolation.as_str(), wait), ("READ-COMMITTED", 3));
    assert!(mode.contains("STRICT_ALL_TABLES"), "{mode}");
    let pool = MySqlStore::pool_options(Duration::from_millis(200))
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let (isolation, wait, mode) = settings(&pool).await;
    assert_eq!(
        (isolation.as_str(), wait),
        ("READ-COMMITTED", 1),
        "under a second is InnoDB's least, 1 s"
    );
    assert!(mode.contains("STRICT_ALL_TABLES"), "{mode}");
    let store = MySqlStore::from_pool(pool);
    store.migrate().await.unwrap();
    let read = safe_retry_server::store::Outcomes::read(&store, "", "k").await;
    assert!(read.unwrap().is_none(), "the migrated table answers");
}

/// A new key's `INSERT` that the server refuses for any reason but a duplicate key (here a
/// trigger's error) is the store's failure, reported: never taken for another claim's win.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_mysql_claim_whose_insert_is_refused_reports_it() {
    use crate::support::Backend;
    use safe_retry_server::store::{Claim, Outcomes};
    let store = safe_retry_server::MySqlStore::fresh().await;
    sqlx::query(
        "CREATE TRIGGER refuse BEFORE INSERT ON safe_retry_outcomes FOR EACH ROW
         SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by a trigger'",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let fingerprint = [5; 32];
    let claim = Claim {
        scope: "",
        key: "k",
        fingerprint: &fingerprint,
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(60),
    };
    let refused = store.try_claim(&claim).await.unwrap_err();
    assert!(
        format!("{:?}", refused).contains("refused by a trigger"),
        "{refused:?}"
    );
    assert_eq!(store.outcomes().await, []);
}

/// An outbox message id longer than the MySQL table keeps (768 bytes) is refused with an error
/// naming the limit, never cut short into another message's id; one at the limit is staged.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn a_mysql_outbox_id_past_its_column_is_refused_naming_the_limit() {
    use crate::support::{Backend, ChargesDb};
    use safe_retry_server::store::{Outbox, Outcomes, StagedMessage};
    let store = safe_retry_server::MySqlStore::fresh().await;
    let message = |id: &'static str| StagedMessage {
        id,
        method: "POST",
        url: "http://127.0.0.1:1/receipts",
        headers: &[],
        body: b"{}",
    };
    let at_limit: &'static str = "m".repeat(768).leak();
    let past: &'static str = "m".repeat(769).leak();
    let mut tx = store.begin().await.unwrap();
    store.stage(&mut tx, &message(at_limit)).await.unwrap();
    let refused = store.stage(&mut tx, &message(past)).await.unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("at most 768 bytes; this one is 769"),
        "{refused}"
    );
    <safe_retry_server::MySqlStore as Backend>::commit(tx).await;
    let staged = store.outbox().await.unwrap();
    assert_eq!(staged.len(), 1);
    assert_eq!(staged[0].0.len(), 768);
}
