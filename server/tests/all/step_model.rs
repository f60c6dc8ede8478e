//! The step model: random scripts of orders, crashes at recovery points (a handler that fails,
//! or a request dropped mid-way), lease expiries, reconciler ticks, relay ticks and a receipt
//! service going down and up, against a reference model whose promise is one charge, one order
//! row and one receipt per key, and one answer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use safe_retry_server::{Reconciler, Relay};

use crate::orders_app::{Crash, POINTS};
use crate::steps::World;
use crate::support::{Answer, Backend, post};

#[derive(Debug, Clone)]
enum Op {
    /// A client's attempt for key `k`.
    Send(usize),
    /// A fault at a point (hang or fail), for the next client attempt.
    Arm(usize, bool),
    /// The lease of key `k`'s record ends.
    EndLease(usize),
    /// A reconciler tick.
    Reconcile,
    /// A relay tick.
    Relay,
    /// The receipt service goes down (true) or comes back.
    ReceiptsDown(bool),
}

const KEYS: usize = 3;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS).prop_map(Op::Send),
        2 => (0..POINTS.len(), any::<bool>()).prop_map(|(p, hang)| Op::Arm(p, hang)),
        2 => (0..KEYS).prop_map(Op::EndLease),
        2 => Just(Op::Reconcile),
        2 => Just(Op::Relay),
        1 => any::<bool>().prop_map(Op::ReceiptsDown),
    ]
}

/// What the model knows of one key.
#[derive(Debug, Default)]
struct Model {
    /// Sent at least once.
    sent: bool,
    /// The completed answer, once a client saw it.
    answer: Option<Answer>,
}

/// Every key's effects, read from the service's table and the two receivers: (order rows,
/// charges, receipts).
async fn effects<S: Backend>(world: &World<S>, key: &str) -> (usize, usize, usize) {
    let orders: Vec<i64> = world
        .store
        .effects()
        .await
        .unwrap()
        .iter()
        .filter(|e| e.key == key)
        .map(|e| e.id)
        .collect();
    let of = |effects: Vec<(String, String)>| {
        effects
            .iter()
            .filter(|(_, body)| {
                let body: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
                orders.iter().any(|id| body["order"] == *id)
            })
            .count()
    };
    (
        orders.len(),
        of(world.payments.effects()),
        of(world.receipts.effects()),
    )
}

/// Sends one attempt; a fault armed to hang drops the request once its point is reached.
async fn send<S: Backend>(world: &World<S>, key: &str) -> Option<Answer> {
    let (caller, url, key) = (
        world.caller.clone(),
        world.server.url("/orders"),
        key.to_owned(),
    );
    let mut request =
        tokio::spawn(async move { post(&caller, &url, Some(&key), r#"{"item":"book"}"#).await });
    tokio::select! {
        answer = &mut request => Some(answer.unwrap()),
        () = world.faults.reached() => {
            // A fault that fails answers by itself; one that hangs is dropped here.
            match tokio::time::timeout(Duration::from_millis(20), &mut request).await {
                Ok(answer) => Some(answer.unwrap()),
                Err(_) => {
                    request.abort();
                    None
                }
            }
        }
    }
}

async fn run_script<S: Backend>(
    world: &World<S>,
    reconciler: &Reconciler<axum::Router, S>,
    relay: &Relay<S>,
    case: u64,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let key = |k: usize| format!("m{case}-{k}");
    let mut model: BTreeMap<usize, Model> = BTreeMap::new();
    // Armed only for a client's attempt: a crash in the reconciler's resumption is a crash
    // of its process, which this in-process model does not kill.
    let mut fault = None;
    let check = |k: usize, model: &Model, answer: &Answer| -> Result<(), TestCaseError> {
        if let Some(done) = &model.answer {
            prop_assert_eq!(
                &answer.unmarked(),
                done,
                "key {} answered twice differently",
                k
            );
        }
        Ok(())
    };
    for op in ops {
        match op {
            Op::Send(k) => {
                let entry = model.entry(*k).or_default();
                entry.sent = true;
                if let Some((point, crash)) = fault.take() {
                    world.faults.arm(point, crash);
                }
                let answer = send(world, &key(*k)).await;
                world.faults.disarm();
                if let Some(answer) = answer {
                    prop_assert!(
                        matches!(answer.status, 201 | 409 | 503),
                        "unexpected {:?}",
                        answer
                    );
                    if answer.status == 201 {
                        check(*k, entry, &answer)?;
                        entry.answer = Some(answer.unmarked());
                    }
                }
            }
            Op::Arm(point, hang) => {
                fault = Some((
                    POINTS[*point],
                    if *hang { Crash::Hang } else { Crash::Fail },
                ));
            }
            Op::EndLease(k) => world.store.end_lease(&key(*k)).await,
            Op::Reconcile => {
                reconciler.tick().await.unwrap();
            }
            Op::Relay => {
                relay.tick().await.unwrap();
            }
            Op::ReceiptsDown(down) => world.receipts.down.store(*down, Ordering::SeqCst),
        }
        for k in model.keys() {
            let (orders, charges, receipts) = effects(world, &key(*k)).await;
            prop_assert!(
                orders <= 1 && charges <= 1 && receipts <= 1,
                "key {}: {} order rows, {} charges, {} receipts after {:?}",
                k,
                orders,
                charges,
                receipts,
                op
            );
        }
    }

    // The end: no more faults, the receiver up, every lease over; a retry of each key and the
    // relay finish everything, once.
    world.faults.disarm();
    world.receipts.down.store(false, Ordering::SeqCst);
    for (k, entry) in &mut model {
        if !entry.sent {
            continue;
        }
        let mut answer = None;
        for _ in 0..5 {
            world.store.end_lease(&key(*k)).await;
            if let Some(a) = send(world, &key(*k)).await
                && a.status == 201
            {
                answer = Some(a);
                break;
            }
        }
        let answer = answer.expect("a retry finishes the order");
        check(*k, entry, &answer)?;
    }
    for _ in 0..5 {
        if relay.tick().await.unwrap().taken == 0 {
            break;
        }
    }
    for (k, entry) in &model {
        if entry.sent {
            prop_assert_eq!(effects(world, &key(*k)).await, (1, 1, 1), "key {}", k);
        }
    }
    Ok(())
}

fn check<S: Backend>(cases: u32) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let world = runtime.block_on(World::<S>::new(|b| b.max_attempts(1000)));
    let reconciler = world.layer.reconciler(world.app.clone());
    let relay = world.relay(Duration::from_secs(5));
    let case = AtomicU64::new(0);
    let config = ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(ops in proptest::collection::vec(op(), 1..24))| {
        let case = case.fetch_add(1, Ordering::Relaxed);
        let script = run_script(&world, &reconciler, &relay, case, &ops);
        runtime
            .block_on(async { tokio::time::timeout(Duration::from_secs(5), script).await })
            .map_err(|_| TestCaseError::fail("the script did not end in 5 s"))??;
    });
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_steps_keep_the_model_s_promises() {
    check::<safe_retry_server::SqliteStore>(24);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_steps_keep_the_model_s_promises() {
    check::<safe_retry_server::PostgresStore>(16);
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_steps_keep_the_model_s_promises() {
    check::<safe_retry_server::MySqlStore>(16);
}
