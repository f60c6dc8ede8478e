//! The events a layer logs, read by a subscriber of the test's own: their names, their levels
//! (the defaults, and a level the builder changed), and no line for a tick that did nothing.

use std::sync::{Arc, Mutex};

use safe_retry_server::{Event, IdempotencyLayer, SqliteStore, Sweeper};
use tracing::Level;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Metadata, Subscriber};

/// Keeps each event of target `safe_retry_server`: its `event` field and its level.
#[derive(Clone, Default)]
struct Kept(Arc<Mutex<Vec<(String, Level)>>>);

struct EventName(Option<String>);

impl Visit for EventName {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "event" {
            self.0 = Some(value.to_owned());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "event" {
            self.0 = Some(format!("{value:?}").trim_matches('"').to_owned());
        }
    }
}

impl Subscriber for Kept {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if event.metadata().target() != "safe_retry_server" {
            return;
        }
        let mut name = EventName(None);
        event.record(&mut name);
        if let Some(name) = name.0 {
            self.0
                .lock()
                .unwrap()
                .push((name, *event.metadata().level()));
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

impl Kept {
    fn levels_of(&self, name: &str) -> Vec<Level> {
        let kept = self.0.lock().unwrap();
        kept.iter()
            .filter(|(n, _)| n == name)
            .map(|(_, l)| *l)
            .collect()
    }
}

async fn order(router: &mut axum::Router, key: &str) -> u16 {
    let request = http::Request::post("/orders")
        .header("idempotency-key", key)
        .body(axum::body::Body::from("x"))
        .unwrap();
    tower_service::Service::call(router, request)
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[test]
fn replays_are_info_by_default_a_level_can_be_changed_and_idle_ticks_say_nothing() {
    let kept = Kept::default();
    tracing::subscriber::with_default(kept.clone(), || {
        crate::support::on_this_thread(async {
            let store = SqliteStore::memory().await.unwrap();
            let layer = IdempotencyLayer::builder(store.clone())
                .shared_scope()
                .event_level(Event::Claim, Level::WARN)
                .build()
                .unwrap();
            let mut router = axum::Router::new()
                .route("/orders", axum::routing::post(|| async { "done" }))
                .layer(layer.clone());
            assert_eq!(order(&mut router, "k").await, 200);
            assert_eq!(order(&mut router, "k").await, 200);
            let missing = http::Request::post("/orders")
                .body(axum::body::Body::from("x"))
                .unwrap();
            let refused = tower_service::Service::call(&mut router, missing)
                .await
                .unwrap();
            assert_eq!(refused.status(), 400);
            // Ticks with nothing to do.
            let reconciler = layer.reconciler(router.clone());
            assert_eq!(reconciler.tick().await.unwrap().found, 0);
            assert_eq!(Sweeper::new(store.clone()).tick().await.unwrap().deleted, 0);
            let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).build();
            let relay = safe_retry_server::Relay::new(store, client);
            assert_eq!(relay.tick().await.unwrap().taken, 0);
        });
    });
    assert_eq!(kept.levels_of("replay"), [Level::INFO]);
    assert_eq!(kept.levels_of("refused"), [Level::INFO]);
    assert_eq!(kept.levels_of("completed"), [Level::DEBUG]);
    assert_eq!(
        kept.levels_of("claim"),
        [Level::WARN],
        "the level the builder set"
    );
    assert!(
        kept.levels_of("reconciled").is_empty(),
        "an idle tick logs nothing"
    );
    assert!(
        kept.levels_of("swept").is_empty(),
        "an idle sweep logs nothing"
    );
    assert!(
        kept.levels_of("relayed").is_empty(),
        "an idle relay logs nothing"
    );
}

/// A handler that commits a step and then stops: its record waits at the recovery point.
async fn stops_after_a_step(
    axum::Extension(execution): axum::Extension<safe_retry_server::Execution<SqliteStore>>,
) -> Result<&'static str, safe_retry_server::StepError> {
    if let safe_retry_server::Step::Todo(step) = execution.step::<()>("first").await? {
        step.commit(()).await?;
    }
    Err(safe_retry_server::StepError::Misuse(
        "stopped after its first step",
    ))
}

#[test]
fn a_tick_that_did_something_says_what() {
    use safe_retry_server::store::{Outbox, Outcomes, StagedMessage};
    let kept = Kept::default();
    tracing::subscriber::with_default(kept.clone(), || {
        crate::support::on_this_thread(async {
            let store = SqliteStore::memory().await.unwrap();
            let layer = IdempotencyLayer::builder(store.clone())
                .shared_scope()
                .build()
                .unwrap();
            let mut router = axum::Router::new()
                .route("/orders", axum::routing::post(stops_after_a_step))
                .layer(layer.clone());
            assert_eq!(order(&mut router, "k").await, 503);
            let reconciler = layer.reconciler(router.clone());
            assert_eq!(reconciler.tick().await.unwrap().found, 1);

            let mut tx = store.begin().await.unwrap();
            let message = StagedMessage {
                id: "m-1",
                method: "POST",
                url: "http://127.0.0.1:1/receipts",
                headers: &[],
                body: b"",
            };
            store.stage(&mut tx, &message).await.unwrap();
            tx.commit().await.unwrap();
            let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).build();
            let relay = safe_retry_server::Relay::new(store.clone(), client);
            assert_eq!(relay.tick().await.unwrap().taken, 1);

            // A record in progress at a recovery point is never swept: this one ends first.
            sqlx::query(
                "UPDATE safe_retry_outcomes
                 SET status = 'failed', response_status = 500, expires_at = 0, locked_until = NULL",
            )
            .execute(store.pool())
            .await
            .unwrap();
            assert_eq!(Sweeper::new(store).tick().await.unwrap().deleted, 1);
        });
    });
    assert_eq!(kept.levels_of("reconciled"), [Level::INFO]);
    assert_eq!(kept.levels_of("relayed"), [Level::INFO]);
    assert_eq!(kept.levels_of("delivery_retry"), [Level::INFO]);
    assert_eq!(kept.levels_of("swept"), [Level::INFO]);
    assert_eq!(kept.levels_of("unfinished"), [Level::INFO, Level::INFO]);
}
