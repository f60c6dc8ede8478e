//! Recovery points, resumption, the reconciler and the outbox, on every store: the charge of
//! the README (`examples/support/orders_app.rs`) against a payment provider and a receipt
//! service on loopback that dedupe on the key and count their effects.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{Dependency, RetryMiddleware, RetryPolicy};
use safe_retry_server::{Builder, IdempotencyLayer, Relay};

use crate::orders_app::{Crash, Faults, Orders, orders_app};
use crate::receiver::Receiver;
use crate::support::{Answer, Backend, Running, post};

/// The service, its dependencies and the clients around them.
pub struct World<S: Backend> {
    pub store: S,
    pub layer: IdempotencyLayer<S>,
    pub app: axum::Router,
    pub server: Running,
    pub payments: Arc<Receiver>,
    pub receipts: Arc<Receiver>,
    pub faults: Arc<Faults>,
    pub caller: reqwest::Client,
}

/// This workspace's client, as the service and the relay reach their dependencies: 3
/// attempts, short waits, and a timeout per attempt of `timeout`.
pub fn downstream_client(timeout: Duration) -> ClientWithMiddleware {
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .base_delay(Duration::from_millis(2))
        .max_delay(Duration::from_millis(10))
        .build()
        .unwrap();
    ClientBuilder::new(reqwest::Client::builder().timeout(timeout).build().unwrap())
        .with(RetryMiddleware::new(Dependency::new(
            "dependencies",
            policy,
        )))
        .build()
}

impl<S: Backend> World<S> {
    pub async fn new(configure: impl FnOnce(Builder<S>) -> Builder<S>) -> World<S> {
        World::with_client(configure, downstream_client(Duration::from_secs(5))).await
    }

    /// A world whose service calls its dependencies through `client`.
    pub async fn with_client(
        configure: impl FnOnce(Builder<S>) -> Builder<S>,
        client: ClientWithMiddleware,
    ) -> World<S> {
        let store = S::fresh().await;
        let layer = configure(IdempotencyLayer::builder(store.clone()).shared_scope())
            .build()
            .unwrap();
        let (payments_addr, payments) = Receiver::start("ch").await;
        let (receipts_addr, receipts) = Receiver::start("rc").await;
        let faults = Arc::new(Faults::default());
        let app = orders_app(
            layer.clone(),
            Orders {
                client,
                payments: format!("http://{payments_addr}"),
                receipts: format!("http://{receipts_addr}"),
                faults: faults.clone(),
            },
        );
        let server = Running::start(app.clone()).await;
        World {
            store,
            layer,
            app,
            server,
            payments,
            receipts,
            faults,
            caller: reqwest::Client::new(),
        }
    }

    pub async fn order(&self, key: &str) -> Answer {
        post(&self.caller, &self.server.url("/orders"), Some(key), BODY).await
    }

    pub fn relay(&self, timeout: Duration) -> Relay<S> {
        Relay::new(self.store.clone(), downstream_client(timeout)).retry_after(Duration::ZERO)
    }

    /// The order rows (the local effect) of `key`.
    pub async fn orders_of(&self, key: &str) -> usize {
        self.store
            .effects()
            .await
            .unwrap()
            .iter()
            .filter(|e| e.key == key)
            .count()
    }

    /// Waits (at most 2 s) until `key`'s record can be resumed: its lease ended.
    pub async fn until_stalled(&self, key: &str) {
        for _ in 0..200 {
            let stalled = self.store.stalled(100).await.unwrap();
            if stalled.iter().any(|s| s.key == key) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{key}'s record never stalled");
    }
}

/// The handler fails after the provider answered and before the charge step committed; the
/// client's retry resumes at the charge step: one charge, under one key, one order row, and the
/// completed answer.
/// Waits (at most 5 s) until the order reaches its armed crash point.
pub async fn reached(faults: &crate::orders_app::Faults) {
    tokio::time::timeout(Duration::from_secs(5), faults.reached())
        .await
        .expect("the point is reached within 5 s");
}

/// Waits (at most 5 s) for a permit the service or a receiver gives when it reaches a point.
pub async fn signalled(semaphore: &tokio::sync::Semaphore) {
    tokio::time::timeout(Duration::from_secs(5), semaphore.acquire())
        .await
        .expect("the point is reached within 5 s")
        .expect("never closed")
        .forget();
}

/// The body of every order.
const BODY: &str = r#"{"item":"book"}"#;

pub async fn a_crash_after_the_call_is_finished_by_the_retry<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    world.faults.arm("after-charge-call", Crash::Fail);
    let first = world.order("k-1").await;
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(world.payments.effects().len(), 1);
    assert_eq!(
        world.store.point_of("k-1").await.as_deref(),
        Some("charge:started")
    );

    let retry = world.order("k-1").await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), None);
    // The provider was called twice, with one key: the second call was its replay.
    assert_eq!(world.payments.calls.load(Ordering::SeqCst), 2);
    assert_eq!(world.payments.effects().len(), 1);
    assert_eq!(world.orders_of("k-1").await, 1);
    let json: serde_json::Value = serde_json::from_slice(&retry.body).unwrap();
    assert_eq!(json["charge"], "ch_1");
    // The provider told the resumed call it replayed the first try's answer.
    assert_eq!(json["charge_replayed"], true);

    let again = world.order("k-1").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.unmarked(), retry);
    let counters = world.layer.counters().snapshot();
    assert_eq!((counters.claims, counters.takeovers), (2, 1));
    assert_eq!(counters.unfinished, 1);
    // order:done, charge:started (twice), charge:done, receipt:done.
    assert_eq!(counters.steps, 5);
}

/// The request is dropped (the caller hangs up) after the provider answered and before the
/// charge step committed; nobody retries: the reconciler finishes it.
pub async fn a_dropped_request_is_finished_by_the_reconciler<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    world.faults.arm("after-charge-call", Crash::Hang);
    let (caller, url) = (world.caller.clone(), world.server.url("/orders"));
    let hung = tokio::spawn(async move { post(&caller, &url, Some("k-2"), BODY).await });
    reached(&world.faults).await;
    hung.abort();
    world.until_stalled("k-2").await;

    let reconciler = world.layer.reconciler(world.app.clone());
    let report = reconciler.tick().await.unwrap();
    assert_eq!((report.found, report.completed), (1, 1), "{report:?}");
    assert_eq!(world.payments.effects().len(), 1);
    assert_eq!(world.payments.calls.load(Ordering::SeqCst), 2);
    assert_eq!(world.orders_of("k-2").await, 1);
    assert_eq!(reconciler.tick().await.unwrap().found, 0);

    let later = world.order("k-2").await;
    assert_eq!(later.status, 201);
    assert_eq!(later.header("idempotent-replayed"), Some("true"));
    // The reconciler ran the request as saved, body and all.
    assert_eq!(world.store.effects().await.unwrap()[0].body, BODY);

    let relayed = world.relay(Duration::from_secs(5)).tick().await.unwrap();
    assert_eq!(relayed.sent, 1);
    assert_eq!(world.receipts.effects().len(), 1);
}

/// The first holder pauses after its call; its lease ends and a retry resumes and finishes the
/// record; the first wakes and commits its step: refused, rolled back, counted; one charge.
/// The first's caller is told what happened: the stored outcome, replayed, never a `409` that
/// a client on a fresh key would take as final (and resubmit under a new key: a second charge).
pub async fn a_holder_that_wakes_after_a_resumption_is_fenced<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    world.faults.arm("after-charge-call", Crash::Pause);
    let (caller, url) = (world.caller.clone(), world.server.url("/orders"));
    let first = tokio::spawn(async move { post(&caller, &url, Some("k-3"), BODY).await });
    reached(&world.faults).await;
    world.store.end_lease("k-3").await;

    let retry = world.order("k-3").await;
    assert_eq!(retry.status, 201, "{retry:?}");
    world.faults.resume();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.header("idempotent-replayed"), Some("true"));
    assert_eq!(first.unmarked(), retry);
    assert_eq!(world.layer.counters().snapshot().fenced, 1);
    assert_eq!(world.payments.effects().len(), 1);
    assert_eq!(world.orders_of("k-3").await, 1);
    assert_eq!(world.store.outbox().await.unwrap().len(), 1);
    let replay = world.order("k-3").await;
    assert_eq!(replay.unmarked(), retry);
}

/// Two reconcilers and a client's retry resume the same stalled records at once: each record
/// is resumed once, with one charge and one order row.
pub async fn reconcilers_racing_a_retry_resume_each_record_once<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    let keys: Vec<String> = (0..6).map(|i| format!("race-{i}")).collect();
    for key in &keys {
        world.faults.arm("after-order", Crash::Fail);
        assert_eq!(world.order(key).await.status, 503);
    }
    let first = world.layer.reconciler(world.app.clone()).batch(4);
    let second = world.layer.reconciler(world.app.clone()).batch(4);
    let retries = async {
        let mut fresh = 0;
        for key in &keys {
            let answer = world.order(key).await;
            assert!(matches!(answer.status, 201 | 409), "{answer:?}");
            if answer.status == 201 && answer.header("idempotent-replayed").is_none() {
                fresh += 1;
            }
        }
        fresh
    };
    let (a, b, fresh) = tokio::join!(first.tick(), second.tick(), retries);
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.unfinished + b.unfinished, 0, "{a:?} {b:?}");
    // Whatever was left (records the racers passed by) is finished by one more tick.
    let rest = first.tick().await.unwrap();
    assert_eq!(
        a.completed + b.completed + fresh + rest.completed,
        keys.len(),
        "{a:?} {b:?} {rest:?} fresh {fresh}"
    );
    for key in &keys {
        assert_eq!(world.orders_of(key).await, 1, "{key}");
        assert_eq!(world.order(key).await.status, 201);
    }
    assert_eq!(world.payments.effects().len(), keys.len());
    let counters = world.layer.counters().snapshot();
    assert_eq!(counters.claims, 2 * keys.len() as u64, "{counters:?}");
}

/// The relay dies after the receiver performed the delivery and before it marked the message
/// sent (its tick is dropped while the receiver holds the answer): once the relay's lease on
/// the message ends, the next delivery carries the same key and the receiver collapses it.
pub async fn a_delivery_made_again_is_collapsed_by_its_key<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    assert_eq!(world.order("k-5").await.status, 201);
    world.receipts.hold.store(true, Ordering::SeqCst);
    let relay = world
        .relay(Duration::from_secs(5))
        .lease(Duration::from_millis(100));
    let dying = relay.clone();
    let tick = tokio::spawn(async move { dying.tick().await });
    signalled(&world.receipts.held).await;
    tick.abort();
    assert_eq!(world.receipts.effects().len(), 1);
    assert_eq!(world.store.outbox().await.unwrap()[0].1, "pending");

    world.receipts.hold.store(false, Ordering::SeqCst);
    let mut report = relay.tick().await.unwrap();
    for _ in 0..100 {
        if report.taken > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        report = relay.tick().await.unwrap();
    }
    assert_eq!(report.sent, 1, "{report:?}");
    assert_eq!(world.receipts.effects().len(), 1);
    assert_eq!(world.receipts.calls.load(Ordering::SeqCst), 2);
    let outbox = world.store.outbox().await.unwrap();
    assert_eq!((outbox[0].1.as_str(), outbox[0].2), ("sent", 2));
    assert_eq!(relay.tick().await.unwrap().taken, 0);
}

/// A receiver down for a while: the client's attempts within one delivery are its own
/// policy's (3), the message waits, and is delivered when the receiver returns.
pub async fn a_receiver_down_for_a_while_gets_the_message_when_it_returns<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    assert_eq!(world.order("k-6").await.status, 201);
    world.receipts.down.store(true, Ordering::SeqCst);
    let relay = world.relay(Duration::from_secs(5));
    let report = relay.tick().await.unwrap();
    assert_eq!(report.retrying, 1, "{report:?}");
    assert_eq!(world.receipts.calls.load(Ordering::SeqCst), 3);
    assert_eq!(world.store.outbox().await.unwrap()[0].1, "pending");

    world.receipts.down.store(false, Ordering::SeqCst);
    assert_eq!(relay.tick().await.unwrap().sent, 1);
    assert_eq!(world.receipts.effects().len(), 1);
    assert_eq!(world.store.outbox().await.unwrap()[0].2, 2);
}

/// A dependency that never answers: the record is resumed until `max_attempts`, then ends
/// failed with its own retention, and every later request gets the `gave-up` answer; the sweep
/// removes failed records and sent messages once their retention ends.
pub async fn a_record_resumed_too_often_ends_failed_and_is_swept<S: Backend>() {
    let world = World::<S>::new(|b| b.max_attempts(3)).await;
    world.payments.down.store(true, Ordering::SeqCst);
    let first = world.order("k-7").await;
    assert_eq!(first.status, 503, "{first:?}");
    let reconciler = world.layer.reconciler(world.app.clone());
    for _ in 0..2 {
        assert_eq!(reconciler.tick().await.unwrap().unfinished, 1);
    }
    assert_eq!(reconciler.tick().await.unwrap().failed, 1);
    assert_eq!(reconciler.tick().await.unwrap().found, 0);
    let gave_up = world.order("k-7").await;
    assert_eq!(gave_up.status, 500);
    assert_eq!(gave_up.problem_type(), "urn:safe-retry:problem:gave-up");
    assert_eq!(gave_up.header("idempotent-replayed"), Some("true"));
    assert_eq!(world.store.outcomes().await[0].1, "failed");
    assert_eq!(world.payments.effects().len(), 0);
    assert_eq!(world.layer.counters().snapshot().failed, 1);

    // A completed order whose receipt was sent, kept for no time.
    world.payments.down.store(false, Ordering::SeqCst);
    assert_eq!(world.order("k-8").await.status, 201);
    let relay = world
        .relay(Duration::from_secs(5))
        .keep_sent(Duration::ZERO);
    assert_eq!(relay.tick().await.unwrap().sent, 1);
    // The failed record is kept for its retention (7 days), and the completed one for 24 h.
    assert_eq!(world.store.sweep(100).await.unwrap(), 1, "the sent message");
    world.store.end_retention(None).await;
    assert_eq!(world.store.sweep(100).await.unwrap(), 2);
    assert!(world.store.outcomes().await.is_empty());
    assert!(world.store.outbox().await.unwrap().is_empty());
}

/// A client without this workspace's middleware would send the charge without a key: the step
/// refuses to go on (the record waits for a resumption with the right client), and the relay
/// keeps the message pending, each saying why.
pub async fn a_client_without_the_middleware_is_refused<S: Backend>() {
    let plain = ClientBuilder::new(reqwest::Client::new()).build();
    let world = World::<S>::with_client(|b| b, plain.clone()).await;
    let answer = world.order("k-9").await;
    assert_eq!(answer.status, 503, "{answer:?}");
    let detail: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert!(
        detail["detail"]
            .as_str()
            .unwrap()
            .contains("RetryMiddleware"),
        "{detail}"
    );
    assert_eq!(world.orders_of("k-9").await, 1);
    assert_eq!(
        world.store.point_of("k-9").await.as_deref(),
        Some("charge:started")
    );

    let world = World::<S>::new(|b| b).await;
    assert_eq!(world.order("k-10").await.status, 201);
    let report = Relay::new(world.store.clone(), plain).tick().await.unwrap();
    assert_eq!(report.retrying, 1, "{report:?}");
    assert_eq!(world.store.outbox().await.unwrap()[0].1, "pending");
}

/// A saved request that no longer decodes (edited by hand, or by an incompatible release) is
/// never resumed: the reconciler ends the record failed instead of finding it on every tick.
pub async fn a_record_whose_request_does_not_decode_ends_failed<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    world.faults.arm("after-order", Crash::Fail);
    assert_eq!(world.order("k-11").await.status, 503);
    world.store.garble_request("k-11").await;
    let reconciler = world.layer.reconciler(world.app.clone());
    let report = reconciler.tick().await.unwrap();
    assert_eq!((report.found, report.failed), (1, 1), "{report:?}");
    assert_eq!(reconciler.tick().await.unwrap().found, 0);
    let answer = world.order("k-11").await;
    assert_eq!(answer.status, 500);
    assert_eq!(answer.problem_type(), "urn:safe-retry:problem:gave-up");
    assert_eq!(world.payments.effects().len(), 0);
}

/// What a reconciler and a relay show of themselves.
pub async fn reconcilers_and_relays_show_their_settings<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    let reconciler = format!("{:?}", world.layer.reconciler(world.app.clone()).batch(7));
    assert!(
        reconciler.starts_with("Reconciler { batch: 7"),
        "{reconciler}"
    );
    let relay = format!(
        "{:?}",
        world
            .relay(Duration::from_secs(1))
            .batch(5)
            .max_deliveries(4)
            .keep_failed(Duration::from_secs(9))
    );
    for shown in [
        "batch: 5",
        "retry_after: 0ns",
        "max_deliveries: 4",
        "keep_failed: 9s",
        "keep_sent: 86400s",
        "lease: 60s",
    ] {
        assert!(relay.contains(shown), "{relay} lacks {shown}");
    }
}

/// `run` ticks again at once while a tick fills its batch, then waits for its interval: three
/// stalled records are resumed by batches of one straight away, and a fourth, stalled after
/// that, waits for the next interval (an hour away). The relay's `run` the same.
pub async fn run_drains_full_batches_then_waits_for_its_interval<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    for key in ["r-1", "r-2", "r-3"] {
        world.faults.arm("after-order", Crash::Fail);
        assert_eq!(world.order(key).await.status, 503);
    }
    let hour = Duration::from_secs(3600);
    let reconciler = tokio::spawn(world.layer.reconciler(world.app.clone()).batch(1).run(hour));
    // Every record resumed: its receipt staged.
    let staged = |count: usize, status: &'static str| {
        let store = world.store.clone();
        async move {
            for _ in 0..200 {
                let outbox = store.outbox().await.unwrap();
                if outbox.len() == count && outbox.iter().all(|m| m.1 == status) {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            false
        }
    };
    assert!(
        staged(3, "pending").await,
        "{:?}",
        world.store.outbox().await.unwrap()
    );
    let relay = tokio::spawn(world.relay(Duration::from_secs(5)).batch(1).run(hour));
    let done = staged(3, "sent").await;
    assert!(done, "{:?}", world.store.outbox().await.unwrap());
    assert_eq!(world.receipts.effects().len(), 3);

    world.faults.arm("after-order", Crash::Fail);
    assert_eq!(world.order("r-4").await.status, 503);
    assert_eq!(world.order("r-5").await.status, 201);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(world.store.stalled(10).await.unwrap().len(), 1, "r-4 waits");
    assert_eq!(world.receipts.effects().len(), 3, "r-5's receipt waits");
    reconciler.abort();
    relay.abort();
}

/// The store fails between a delivery and its settlement: the tick reports it, and the
/// message (its row untouched) would be due again after the relay's lease.
pub async fn a_settlement_the_store_refuses_is_reported<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    assert_eq!(world.order("k-12").await.status, 201);
    world.receipts.hold.store(true, Ordering::SeqCst);
    // Each attempt waits 300 ms at most: the held one times out, the next is the receiver's
    // replay.
    let relay = world.relay(Duration::from_millis(300));
    let tick = tokio::spawn(async move { relay.tick().await });
    signalled(&world.receipts.held).await;
    world.receipts.hold.store(false, Ordering::SeqCst);
    world.store.break_outbox().await;
    let report = tick.await.unwrap().unwrap();
    assert_eq!((report.taken, report.store_failures), (1, 1), "{report:?}");
    assert_eq!(
        report.sent + report.retrying + report.failed + report.lost,
        0
    );
    assert_eq!(world.receipts.effects().len(), 1);
    assert!(world.relay(Duration::from_secs(1)).tick().await.is_err());
}

/// A resumption that another attempt fences is reported lost; one whose store fails is
/// reported as a store failure.
pub async fn a_resumption_fenced_or_failing_is_reported<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    world.faults.arm("after-order", Crash::Fail);
    assert_eq!(world.order("k-13").await.status, 503);
    reached(&world.faults).await;
    world.faults.arm("after-charge-call", Crash::Pause);
    let reconciler = world.layer.reconciler(world.app.clone());
    let tick = tokio::spawn({
        let reconciler = world.layer.reconciler(world.app.clone());
        async move { reconciler.tick().await }
    });
    reached(&world.faults).await;
    world.store.end_lease("k-13").await;
    assert_eq!(world.order("k-13").await.status, 201);
    world.faults.resume();
    let report = tick.await.unwrap().unwrap();
    assert_eq!((report.found, report.lost), (1, 1), "{report:?}");
    assert_eq!(world.payments.effects().len(), 1);

    world.faults.arm("after-order", Crash::Fail);
    assert_eq!(world.order("k-14").await.status, 503);
    reached(&world.faults).await;
    world.faults.arm("after-receipt", Crash::Pause);
    let tick = tokio::spawn(async move { reconciler.tick().await });
    reached(&world.faults).await;
    world.store.break_outcomes().await;
    world.faults.resume();
    let report = tick.await.unwrap().unwrap();
    assert_eq!((report.found, report.store_failures), (1, 1), "{report:?}");
}

/// A relay whose lease on a message ran out while it delivered finds, when it settles, that
/// another relay took the message since: it writes nothing and reports it lost.
pub async fn a_relay_that_outlived_its_lease_settles_nothing<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    assert_eq!(world.order("k-15").await.status, 201);
    world.receipts.hold.store(true, Ordering::SeqCst);
    let slow = world
        .relay(Duration::from_millis(300))
        .lease(Duration::from_millis(50));
    let first = tokio::spawn(async move { slow.tick().await });
    signalled(&world.receipts.held).await;
    world.receipts.hold.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(80)).await;
    let second = world.relay(Duration::from_secs(5)).tick().await.unwrap();
    assert_eq!(second.sent, 1, "{second:?}");
    let first = first.await.unwrap().unwrap();
    assert_eq!((first.taken, first.lost), (1, 1), "{first:?}");
    assert_eq!(world.receipts.effects().len(), 1);
    let outbox = world.store.outbox().await.unwrap();
    assert_eq!((outbox[0].1.as_str(), outbox[0].2), ("sent", 2));
}

/// A provider that answers a transient status (`408`, `429`, `5xx`) after the client's
/// retries has not said whether it charged: the step stays undone; a final `4xx` is kept.
pub async fn a_transient_answer_leaves_the_step_undone_and_a_final_one_is_kept<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    for (i, status) in [408u16, 429, 500, 503].into_iter().enumerate() {
        world.payments.refuse_with.store(status, Ordering::SeqCst);
        let key = format!("t-{i}");
        let answer = world.order(&key).await;
        assert_eq!(answer.status, 503, "{status}: {answer:?}");
        assert_eq!(
            answer.problem_type(),
            "urn:safe-retry:problem:step-unfinished"
        );
        assert_eq!(
            world.store.point_of(&key).await.as_deref(),
            Some("charge:started")
        );
    }
    world.payments.refuse_with.store(402, Ordering::SeqCst);
    let declined = world.order("t-final").await;
    assert_eq!(declined.status, 402, "{declined:?}");
    assert_eq!(
        world.store.point_of("t-final").await.as_deref(),
        Some("charge:done")
    );
    world.payments.refuse_with.store(0, Ordering::SeqCst);
    let first = world.order("t-fresh").await;
    let json: serde_json::Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(json["charge_replayed"], false);
}

/// A message staged in a step's transaction is not delivered before that transaction
/// commits, however often the relay ticks meanwhile; once it commits, it is.
pub async fn a_message_is_never_sent_before_its_transaction_commits<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    world.faults.arm("receipt-staged", Crash::Pause);
    let (caller, url) = (world.caller.clone(), world.server.url("/orders"));
    let order = tokio::spawn(async move { post(&caller, &url, Some("k-16"), BODY).await });
    reached(&world.faults).await;
    // On PostgreSQL the row is invisible; on SQLite the relay waits for the step's write
    // lock. Either way nothing is delivered while the transaction is open.
    let relay = world.relay(Duration::from_secs(5));
    let ticking = tokio::spawn({
        let relay = relay.clone();
        async move {
            let mut sent = 0;
            for _ in 0..5 {
                sent += relay.tick().await.unwrap().sent;
            }
            sent
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(world.receipts.effects().len(), 0);
    world.faults.resume();
    assert_eq!(order.await.unwrap().status, 201);
    let sent = ticking.await.unwrap() + relay.tick().await.unwrap().sent;
    assert_eq!(sent, 1);
    assert_eq!(world.receipts.effects().len(), 1);
}

/// The saved request keeps what a resumption needs and no credentials: the allow-listed
/// headers only (not `authorization`, `proxy-authorization`, `cookie`, an `x-api-key`, nor a
/// header nobody listed), and it is cleared once the record completes.
pub async fn a_saved_request_keeps_no_credentials<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    world.faults.arm("after-order", Crash::Fail);
    let send = || {
        world
            .caller
            .post(world.server.url("/orders?region=eu"))
            .header("idempotency-key", "k-17")
            .header("authorization", "Bearer secret-token")
            .header("proxy-authorization", "Basic proxy-secret")
            .header("cookie", "session=cookie-secret")
            .header("x-api-key", "api-key-secret")
            .header("x-trace", "trace-42")
            .header("content-type", "application/json")
            .header("connection", "keep-alive")
            .body(BODY)
            .send()
    };
    assert_eq!(send().await.unwrap().status(), 503);
    let saved = world.store.saved_request("k-17").await.expect("saved");
    let text = String::from_utf8_lossy(&saved);
    for kept in [
        "POST",
        "/orders?region=eu",
        "content-type",
        "application/json",
        "idempotency-key",
        BODY,
    ] {
        assert!(text.contains(kept), "{kept} is missing from {text:?}");
    }
    for dropped in [
        "secret-token",
        "proxy-secret",
        "cookie-secret",
        "api-key-secret",
        "trace-42",
        "keep-alive",
    ] {
        assert!(!text.contains(dropped), "{dropped} was saved: {text:?}");
    }
    // Completed: nothing of the request is kept at rest any more.
    assert_eq!(send().await.unwrap().status(), 201);
    assert_eq!(world.store.saved_request("k-17").await, None);
}

/// A record that ends failed keeps its answer and its last recovery point, not its request.
pub async fn a_failed_record_keeps_no_request<S: Backend>() {
    let world = World::<S>::new(|b| b.max_attempts(1)).await;
    world.payments.down.store(true, Ordering::SeqCst);
    assert_eq!(world.order("k-19").await.status, 503);
    assert!(world.store.saved_request("k-19").await.is_some());
    let reconciler = world.layer.reconciler(world.app.clone());
    assert_eq!(reconciler.tick().await.unwrap().failed, 1);
    assert_eq!(world.store.outcomes().await[0].1, "failed");
    assert_eq!(world.store.saved_request("k-19").await, None);
    assert_eq!(
        world.store.point_of("k-19").await.as_deref(),
        Some("charge:started")
    );
}

/// A receiver that refuses a message for good (a `4xx` but 408, 409, 425, 429) gets it once:
/// the relay marks it failed, and no later tick takes it again.
pub async fn a_refused_message_is_marked_failed<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    assert_eq!(world.order("k-18").await.status, 201);
    world.receipts.refuse_with.store(410, Ordering::SeqCst);
    let relay = world.relay(Duration::from_secs(5));
    let report = relay.tick().await.unwrap();
    assert_eq!((report.taken, report.failed), (1, 1), "{report:?}");
    assert_eq!(world.receipts.calls.load(Ordering::SeqCst), 1);
    assert_eq!(world.store.outbox().await.unwrap()[0].1, "failed");
    assert_eq!(relay.tick().await.unwrap().taken, 0);
}

on_every_store!(
    a_refused_message_is_marked_failed,
    a_saved_request_keeps_no_credentials,
    a_failed_record_keeps_no_request,
    a_message_is_never_sent_before_its_transaction_commits,
    a_transient_answer_leaves_the_step_undone_and_a_final_one_is_kept,
    a_resumption_fenced_or_failing_is_reported,
    a_relay_that_outlived_its_lease_settles_nothing,
    a_settlement_the_store_refuses_is_reported,
    run_drains_full_batches_then_waits_for_its_interval,
    reconcilers_and_relays_show_their_settings,
    a_record_whose_request_does_not_decode_ends_failed,
    a_client_without_the_middleware_is_refused,
    a_crash_after_the_call_is_finished_by_the_retry,
    a_dropped_request_is_finished_by_the_reconciler,
    a_holder_that_wakes_after_a_resumption_is_fenced,
    reconcilers_racing_a_retry_resume_each_record_once,
    a_delivery_made_again_is_collapsed_by_its_key,
    a_receiver_down_for_a_while_gets_the_message_when_it_returns,
    a_record_resumed_too_often_ends_failed_and_is_swept,
);
