//! Random scripts of claims, completions, releases, lease ends, retention ends and sweeps,
//! run against a real store and a small reference model of the table's promises: after every
//! step, every answer and every record agree with the model.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use proptest::prelude::*;
use safe_retry_server::store::{Claim, Completion, Fence, RecordState, StoredAnswer};

use crate::support::Backend;

const KEYS: u8 = 3;

#[derive(Debug, Clone)]
enum Op {
    /// A request with key `key` and fingerprint `fp` claims.
    Claim { key: u8, fp: u8 },
    /// The holder at this index (modulo the holders so far) completes, writing an effect in
    /// its transaction when `local`.
    Complete { holder: usize, local: bool },
    /// The holder at this index releases (a rejection).
    Release { holder: usize },
    /// The holder at this index abandons (its request ended without an outcome).
    Abandon { holder: usize },
    /// The lease of `key`'s record runs out.
    EndLease { key: u8 },
    /// The retention of `key`'s record runs out.
    EndRetention { key: u8 },
    /// A sweep with a batch larger than the table.
    Sweep,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS, 0..2u8).prop_map(|(key, fp)| Op::Claim { key, fp }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(holder, local)| Op::Complete { holder, local }),
        1 => any::<usize>().prop_map(|holder| Op::Release { holder }),
        1 => any::<usize>().prop_map(|holder| Op::Abandon { holder }),
        2 => (0..KEYS).prop_map(|key| Op::EndLease { key }),
        1 => (0..KEYS).prop_map(|key| Op::EndRetention { key }),
        1 => Just(Op::Sweep),
    ]
}

/// The model's record of one key.
#[derive(Debug, Clone)]
struct Rec {
    /// Which incarnation of the key (a new one after a sweep or release).
    life: u32,
    fp: u8,
    attempt: i64,
    /// The holder whose answer is stored, once completed.
    completed_by: Option<usize>,
    lease_live: bool,
    retention_live: bool,
}

/// A holder: which key, incarnation and attempt it claimed, and its real fence.
#[derive(Debug, Clone)]
struct Holder {
    key: u8,
    life: u32,
    attempt: i64,
    fence: Fence,
}

static CASE: AtomicU64 = AtomicU64::new(0);

async fn run_script<S: Backend>(store: &S, ops: &[Op]) -> Result<(), TestCaseError> {
    let case = CASE.fetch_add(1, Ordering::Relaxed);
    let key_name = |k: u8| format!("model-{}-{case}-{k}", std::process::id());
    // Records expired by earlier cases would be swept with this case's.
    let mut sweeps = 0;
    while store.sweep(1000).await.unwrap() > 0 {
        sweeps += 1;
        prop_assert!(sweeps < 100, "the sweep drains the table in batches");
    }

    let mut model: BTreeMap<u8, Rec> = BTreeMap::new();
    let mut holders: Vec<Holder> = Vec::new();
    let mut lives = 0u32;
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Claim { key, fp } => {
                let name = key_name(key);
                let fingerprint = [fp; 32];
                let claim = Claim {
                    scope: "model",
                    key: &name,
                    fingerprint: &fingerprint,
                    lease: Duration::from_secs(3600),
                    retention: Duration::from_secs(7200),
                };
                let got = store.try_claim(&claim).await.unwrap();
                let expected = match model.get_mut(&key) {
                    None => {
                        lives += 1;
                        model.insert(
                            key,
                            Rec {
                                life: lives,
                                fp,
                                attempt: 1,
                                completed_by: None,
                                lease_live: true,
                                retention_live: true,
                            },
                        );
                        Some((1, false))
                    }
                    Some(rec)
                        if !rec.retention_live
                            && (rec.completed_by.is_some() || !rec.lease_live) =>
                    {
                        *rec = Rec {
                            fp,
                            attempt: rec.attempt + 1,
                            completed_by: None,
                            lease_live: true,
                            retention_live: true,
                            ..*rec
                        };
                        Some((rec.attempt, false))
                    }
                    Some(rec) if rec.completed_by.is_none() && !rec.lease_live && rec.fp == fp => {
                        rec.attempt += 1;
                        rec.lease_live = true;
                        Some((rec.attempt, true))
                    }
                    Some(_) => None,
                };
                prop_assert_eq!(
                    got.as_ref().map(|c| (c.fence.attempt, c.taken_over)),
                    expected,
                    "step {}: {:?}",
                    step,
                    op
                );
                if let Some(claimed) = got {
                    let rec = &model[&key];
                    holders.push(Holder {
                        key,
                        life: rec.life,
                        attempt: rec.attempt,
                        fence: claimed.fence,
                    });
                }
            }
            Op::Complete { holder, local } if !holders.is_empty() => {
                let index = holder % holders.len();
                let h = holders[index].clone();
                let answer = StoredAnswer {
                    status: StatusCode::CREATED,
                    headers: vec![],
                    body: Some(Bytes::from(format!("holder {index}"))),
                };
                let tx = if local {
                    let mut tx = store.begin().await.unwrap();
                    S::record_effect(
                        &mut tx,
                        &key_name(h.key),
                        &format!("case {case} step {step}"),
                    )
                    .await
                    .unwrap();
                    Some(tx)
                } else {
                    None
                };
                let got = store.complete(tx, h.fence, &answer).await.unwrap();
                let holds = |rec: &Rec| {
                    rec.life == h.life && rec.attempt == h.attempt && rec.completed_by.is_none()
                };
                let expected = match model.get_mut(&h.key) {
                    Some(rec) if holds(rec) => {
                        rec.completed_by = Some(index);
                        Completion::Completed
                    }
                    _ => Completion::Fenced,
                };
                prop_assert_eq!(got, expected, "step {}: {:?} by {:?}", step, op, h);
                if local {
                    let effects = store.effects().await.unwrap();
                    let committed = effects
                        .iter()
                        .any(|e| e.body == format!("case {case} step {step}"));
                    prop_assert_eq!(
                        committed,
                        got == Completion::Completed,
                        "step {}: the effect commits with the completion only",
                        step
                    );
                }
            }
            Op::Release { holder } if !holders.is_empty() => {
                let index = holder % holders.len();
                let h = holders[index].clone();
                let got = store.release(None, h.fence).await.unwrap();
                let expected = matches!(
                    model.get(&h.key),
                    Some(rec) if rec.life == h.life && rec.attempt == h.attempt && rec.completed_by.is_none()
                );
                if expected {
                    model.remove(&h.key);
                }
                prop_assert_eq!(got, expected, "step {}: {:?}", step, op);
            }
            Op::Abandon { holder } if !holders.is_empty() => {
                let index = holder % holders.len();
                let h = holders[index].clone();
                let got = store.abandon(h.fence).await.unwrap();
                let expected = match model.get_mut(&h.key) {
                    Some(rec)
                        if rec.life == h.life
                            && rec.attempt == h.attempt
                            && rec.completed_by.is_none() =>
                    {
                        rec.lease_live = false;
                        true
                    }
                    _ => false,
                };
                prop_assert_eq!(got, expected, "step {}: {:?}", step, op);
            }
            Op::Complete { .. } | Op::Release { .. } | Op::Abandon { .. } => {}
            Op::EndLease { key } => {
                store.end_lease(&key_name(key)).await;
                if let Some(rec) = model.get_mut(&key) {
                    rec.lease_live = false;
                }
            }
            Op::EndRetention { key } => {
                store.end_retention(Some(&key_name(key))).await;
                if let Some(rec) = model.get_mut(&key) {
                    rec.retention_live = false;
                }
            }
            Op::Sweep => {
                let got = store.sweep(1000).await.unwrap();
                let gone: Vec<u8> = model
                    .iter()
                    .filter(|(_, r)| {
                        !r.retention_live && (r.completed_by.is_some() || !r.lease_live)
                    })
                    .map(|(k, _)| *k)
                    .collect();
                for key in &gone {
                    model.remove(key);
                }
                prop_assert_eq!(got, gone.len() as u64, "step {}: sweep", step);
            }
        }

        // Every record reads as the model says.
        for key in 0..KEYS {
            let record = store.read("model", &key_name(key)).await.unwrap();
            match (record, model.get(&key)) {
                (None, None) => {}
                (Some(record), Some(rec)) => {
                    prop_assert_eq!(record.fingerprint, [rec.fp; 32], "step {}", step);
                    match (record.state, rec.completed_by) {
                        (RecordState::Completed(answer), Some(by)) => {
                            prop_assert_eq!(
                                answer.body,
                                Some(Bytes::from(format!("holder {by}"))),
                                "step {}",
                                step
                            );
                        }
                        (RecordState::InProgress { lease_left }, None) => {
                            prop_assert_eq!(!lease_left.is_zero(), rec.lease_live, "step {}", step);
                        }
                        (state, by) => prop_assert!(
                            false,
                            "step {}: key {} reads {:?}, the model has {:?}",
                            step,
                            key,
                            state,
                            by
                        ),
                    }
                }
                (record, rec) => prop_assert!(
                    false,
                    "step {}: key {} reads {:?}, the model has {:?}",
                    step,
                    key,
                    record,
                    rec
                ),
            }
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
    let store = runtime.block_on(S::fresh());
    let config = ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(ops in proptest::collection::vec(op(), 1..40))| {
        runtime.block_on(run_script(&store, &ops))?;
    });
}

#[cfg(feature = "sqlite")]
#[test]
fn the_sqlite_table_keeps_the_model_s_promises() {
    check::<safe_retry_server::SqliteStore>(64);
}

#[cfg(feature = "postgres")]
#[test]
fn the_postgres_table_keeps_the_model_s_promises() {
    check::<safe_retry_server::PostgresStore>(48);
}

#[cfg(feature = "mysql")]
#[test]
fn the_mysql_table_keeps_the_model_s_promises() {
    check::<safe_retry_server::MySqlStore>(48);
}
