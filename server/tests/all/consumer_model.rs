//! The consumer front against a reference model, without a broker: random scripts of
//! deliveries (a few message ids, each with one of two payloads, the handler told to finish,
//! fail without an outcome, or reject) through `Consumer::handle` on SQLite, each verdict and
//! the effects table checked against what a small model says a broker must be told.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use proptest::prelude::*;
use safe_retry_server::consumer::{Delivery, Verdict};
use safe_retry_server::{
    Execution, IdempotencyLayer, Rejected, SqliteStore, StoreError, Unfinished,
};

use crate::charges_app::ChargesDb;

/// What the handler is told to do with a delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behave {
    /// Writes its effect and answers: an outcome.
    Finish,
    /// Answers without an outcome (`Unfinished`): nothing stored, its transaction rolled back.
    Fail,
    /// Refuses before doing anything (`Rejected`).
    Reject,
}

#[derive(Debug, Clone)]
struct Step {
    id: u8,
    payload: u8,
    behave: Behave,
}

fn step() -> impl Strategy<Value = Step> {
    (
        0u8..2,
        0u8..2,
        prop_oneof![
            4 => Just(Behave::Finish),
            4 => Just(Behave::Fail),
            1 => Just(Behave::Reject),
        ],
    )
        .prop_map(|(id, payload, behave)| Step {
            id,
            payload,
            behave,
        })
}

/// The model's record of a message id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    /// In progress under this payload, started this many times.
    Running { payload: u8, starts: u32 },
    /// Done under this payload.
    Done { payload: u8 },
    /// Started too often: failed, under this payload.
    Failed { payload: u8 },
}

const MAX_ATTEMPTS: u32 = 3;

/// What the broker must be told, by the model: `Err(reason)` for a dead letter.
fn expect(records: &mut HashMap<u8, Record>, step: &Step) -> Result<bool, &'static str> {
    let record = records.get(&step.id).copied();
    let starts = match record {
        Some(
            Record::Done { payload } | Record::Failed { payload } | Record::Running { payload, .. },
        ) if payload != step.payload => {
            return Err("key-reused");
        }
        Some(Record::Done { .. }) => return Ok(true),
        Some(Record::Failed { .. }) => return Err("gave-up"),
        Some(Record::Running { starts, .. }) => starts + 1,
        None => 1,
    };
    if starts > MAX_ATTEMPTS {
        records.insert(
            step.id,
            Record::Failed {
                payload: step.payload,
            },
        );
        return Err("gave-up");
    }
    match step.behave {
        Behave::Finish => {
            records.insert(
                step.id,
                Record::Done {
                    payload: step.payload,
                },
            );
            Ok(true)
        }
        Behave::Fail => {
            records.insert(
                step.id,
                Record::Running {
                    payload: step.payload,
                    starts,
                },
            );
            Ok(false)
        }
        Behave::Reject => {
            // A rejection releases the record, earlier starts and all: the id starts afresh.
            records.remove(&step.id);
            Err("rejected")
        }
    }
}

async fn handler(
    Extension(execution): Extension<Execution<SqliteStore>>,
    headers: HeaderMap,
    body: String,
) -> Response {
    let behave = headers
        .get("x-behave")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("finish");
    match behave {
        "reject" => (StatusCode::UNPROCESSABLE_ENTITY, Rejected, "no").into_response(),
        _ => {
            let mut tx = match execution.local().await {
                Ok(tx) => tx,
                Err(error) => return error.into_response(),
            };
            if let Err(error) = SqliteStore::record_effect(&mut tx, execution.key(), &body).await {
                return StoreError::from(error).into_response();
            }
            drop(tx);
            if behave == "fail" {
                // Written, then not an outcome: the effect rolls back with the transaction.
                let mut answer = (StatusCode::SERVICE_UNAVAILABLE, "later").into_response();
                answer.extensions_mut().insert(Unfinished);
                return answer;
            }
            (StatusCode::OK, "done").into_response()
        }
    }
}

async fn run(script: Vec<Step>) -> Result<(), TestCaseError> {
    let store = SqliteStore::memory().await.unwrap();
    store.prepare().await.unwrap();
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .max_attempts(MAX_ATTEMPTS)
        .in_progress_retry_after(Duration::from_millis(7))
        .build_consumer()
        .unwrap();
    let consumer = layer.consumer(Router::new().fallback(post(handler)));
    let mut records = HashMap::new();
    let mut effects: HashMap<String, usize> = HashMap::new();
    for (i, step) in script.iter().enumerate() {
        let behave = match step.behave {
            Behave::Finish => "finish",
            Behave::Fail => "fail",
            Behave::Reject => "reject",
        };
        let delivery = Delivery::new("orders", format!("{{\"p\":{}}}", step.payload))
            .id(format!("m-{}", step.id))
            .header("x-behave", behave.as_bytes());
        let verdict = consumer.handle(delivery).await;
        let expected = expect(&mut records, step);
        match (&expected, &verdict) {
            (Ok(true), Verdict::Ack) => {}
            (Ok(false), Verdict::Retry { after }) => {
                prop_assert_eq!(*after, Duration::from_millis(7));
            }
            (Err(reason), Verdict::DeadLetter(dead)) => {
                prop_assert_eq!(*reason, dead.reason, "step {}: {:?}", i, step);
                if *reason == "rejected" {
                    prop_assert_eq!(
                        &dead.detail,
                        "the handler rejected the message with 422 Unprocessable Entity: no"
                    );
                } else {
                    prop_assert!(!dead.detail.contains("rejected"), "{}", dead.detail);
                }
            }
            _ => prop_assert!(
                false,
                "step {i}: {step:?} gave {verdict:?}, the model says {expected:?}"
            ),
        }
    }
    for effect in store.effects().await.unwrap() {
        *effects.entry(effect.key).or_default() += 1;
    }
    for id in 0..2u8 {
        let done = matches!(records.get(&id), Some(Record::Done { .. }));
        let made = effects.get(&format!("m-{id}")).copied().unwrap_or(0);
        prop_assert_eq!(made, usize::from(done), "m-{}: {:?}", id, records.get(&id));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_script_of_deliveries_gets_the_model_s_verdicts_and_one_effect_per_id_done(
        script in proptest::collection::vec(step(), 1..24)
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(run(script))?;
    }
}

/// A script the model and the front must agree on beyond chance: a failure, a takeover that
/// finishes, a copy, another payload; a rejection, then an id failed until it gives up, its
/// copy given up too, and another payload under it.
#[tokio::test]
async fn a_chosen_script_walks_every_verdict() {
    use Behave::*;
    let script = [
        (0, 0, Fail),
        (0, 0, Finish),
        (0, 0, Finish),
        (0, 1, Finish),
        (1, 0, Reject),
        (1, 1, Fail),
        (1, 1, Fail),
        (1, 1, Fail),
        (1, 1, Finish),
        (1, 1, Finish),
        (1, 0, Finish),
    ]
    .map(|(id, payload, behave)| Step {
        id,
        payload,
        behave,
    });
    run(script.to_vec()).await.unwrap();
}

/// The reconciler finishes a message whose consumer stopped mid-step: the order's charge call
/// reached the provider and the handler failed before its step committed (the verdict:
/// deliver again later); before any redelivery, the reconciler resumes the record at the
/// charge step (the provider answers from its record of the key) and completes it, receipt
/// staged. The redelivery then finds the outcome: acknowledged, nothing run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_finishes_a_message_whose_consumer_stopped_mid_step() {
    use crate::orders_app::{Crash, Faults, Orders};
    let (payments_addr, payments) = crate::receiver::Receiver::start("ch").await;
    let store = SqliteStore::memory().await.unwrap();
    store.prepare().await.unwrap();
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .build_consumer()
        .unwrap();
    let faults = Arc::new(Faults::new());
    let handler = crate::orders_app::orders_handler::<SqliteStore>(Orders {
        client: crate::orders_app::dependencies(Duration::from_secs(2)),
        payments: format!("http://{payments_addr}"),
        receipts: "nats:receipts".into(),
        faults: faults.clone(),
    });
    let consumer = layer.consumer(handler.clone());
    let delivery = || Delivery::new("orders", "{\"amount\":1}").id("order-r");

    faults.arm("after-charge-call", Crash::Fail);
    let verdict = consumer.handle(delivery()).await;
    assert!(matches!(verdict, Verdict::Retry { .. }), "{verdict:?}");
    assert_eq!(payments.effects().len(), 1, "charged before the failure");
    assert_eq!(
        store.record("order-r").await.unwrap(),
        Some(("in_progress".into(), Some("charge:started".into())))
    );

    let report = layer.reconciler(handler).tick().await.unwrap();
    assert_eq!((report.found, report.completed), (1, 1), "{report:?}");
    assert_eq!(
        store.record("order-r").await.unwrap().unwrap().0,
        "completed"
    );
    assert_eq!(consumer.handle(delivery()).await, Verdict::Ack);
    assert_eq!(payments.effects().len(), 1, "one charge");
    assert_eq!(
        payments.calls.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the resumption called again under the key"
    );
    assert_eq!(store.effects().await.unwrap().len(), 1, "one order row");
    let outbox = store.outbox().await.unwrap();
    assert_eq!(outbox.len(), 1, "one receipt staged: {outbox:?}");
    let counts = layer.counters().snapshot();
    assert_eq!((counts.completions, counts.replays), (1, 1), "{counts:?}");
}

/// A consumer layer's key is the delivery's id unless the builder chose a source, and then
/// that source only (the `Idempotency-Key` header chosen on purpose included).
#[tokio::test]
async fn a_consumer_s_key_is_the_message_id_unless_a_source_is_chosen() {
    use safe_retry_server::{KeyForm, KeySource};
    let ok = || Router::new().fallback(post(|| async { "done" }));
    let store = SqliteStore::memory().await.unwrap();
    let by_id = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .build_consumer()
        .unwrap()
        .consumer(ok());
    let header_only = Delivery::new("q", "{}").header("idempotency-key", b"k-1");
    assert!(matches!(
        by_id.handle(header_only.clone()).await,
        Verdict::DeadLetter(ref dead) if dead.reason == "missing-key"
    ));
    assert_eq!(
        by_id.handle(header_only.clone().id("m-1")).await,
        Verdict::Ack
    );

    let by_header = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .key(KeySource::idempotency_key(KeyForm::Either))
        .build_consumer()
        .unwrap();
    let consumer = by_header.consumer(ok());
    assert_eq!(consumer.handle(header_only.clone()).await, Verdict::Ack);
    assert!(matches!(
        consumer.handle(Delivery::new("q", "{}").id("m-2")).await,
        Verdict::DeadLetter(ref dead) if dead.reason == "missing-key"
    ));
    assert_eq!(by_header.counters().snapshot().completions, 1);
    assert_eq!(format!("{consumer:?}"), "Consumer { .. }");
    let shown = format!("{by_header:?}");
    assert!(
        shown.starts_with("ConsumerLayer {") && shown.contains("IdempotencyKey(Either)"),
        "{shown}"
    );
}
