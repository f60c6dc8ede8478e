//! Both halves together: this workspace's client sends keyed POSTs to the charges example
//! through a link that resets connections and drops answers at random (seeded), and every
//! charge happens exactly once.

use std::sync::Arc;
use std::time::Duration;

use crate::lossy_link::{Fate, LossyLink};
use crate::support::{Backend, Running};
use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{Dependency, RetryBudget, RetryMiddleware, RetryPolicy, RetryRecord};
use safe_retry_server::IdempotencyLayer;

pub async fn every_charge_happens_once_through_a_lossy_link<S: Backend>() {
    const CHARGES: usize = 40;
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .build()
        .unwrap();
    let server = Running::start(crate::charges_app::app(
        layer.clone(),
        Duration::from_millis(5),
    ))
    .await;
    let link = LossyLink::start(server.addr, 0x5eed_0042).await;

    // The client as a user sets it up, with a fresh connection per attempt so that the link
    // draws a fate for each, and up to 20 attempts (the link fails 1 in 2 connections: 40 charges all through
    // in 20 is 1 - 40/2^20).
    let policy = RetryPolicy::builder()
        .max_attempts(20)
        .base_delay(Duration::from_millis(5))
        .max_delay(Duration::from_millis(40))
        .deadline(Duration::from_secs(20))
        .build()
        .unwrap();
    // The link fails one connection in two, far past what a retry budget for a healthy
    // service allows: this one holds enough for the run, so the test is about keys.
    let budget = RetryBudget::builder()
        .capacity(1000.0)
        .initial(1000.0)
        .build()
        .unwrap();
    let dependency = Dependency::new("charges", policy).with_budget(budget);
    let reqwest = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let client = Arc::new(
        ClientBuilder::new(reqwest)
            .with(RetryMiddleware::new(dependency))
            .build(),
    );

    let sends: Vec<_> = (0..CHARGES)
        .map(|i| {
            let client = client.clone();
            let url = format!("http://{}/charges", link.addr);
            tokio::spawn(async move {
                let response = client
                    .post(url)
                    .body(format!("charge {i}"))
                    .send()
                    .await
                    .expect("the client rides the link out");
                let record = RetryRecord::of(&response)
                    .expect("a response of the middleware")
                    .clone();
                let key = record
                    .idempotency_key()
                    .expect("a POST carries a key")
                    .to_str()
                    .unwrap()
                    .to_owned();
                (
                    i,
                    response.status().as_u16(),
                    key,
                    format!("{} ({})", record.attempts(), record.stop_reason()),
                )
            })
        })
        .collect();
    let mut answers = Vec::new();
    for send in sends {
        answers.push(send.await.unwrap());
    }

    let effects = store.effects().await.unwrap();
    let fates = link.fates.lock().unwrap().clone();
    for (i, status, key, attempts) in &answers {
        assert_eq!(*status, 201, "charge {i} after {attempts} attempts");
        let mine: Vec<_> = effects.iter().filter(|e| &e.key == key).collect();
        assert_eq!(
            mine.len(),
            1,
            "charge {i} (key {key}) happened once: {mine:?}"
        );
        assert_eq!(mine[0].body, format!("charge {i}"));
    }
    assert_eq!(effects.len(), CHARGES, "no duplicate, none lost");
    // The link did misbehave, each way.
    for fate in [Fate::ResetBefore, Fate::DropAnswer, Fate::CutSoon] {
        assert!(fates.contains(&fate), "the link drew {fate:?}: {fates:?}");
    }
    let counts = layer.counters().snapshot();
    assert!(
        counts.replays >= 1,
        "some answers were lost and replayed: {counts:?}"
    );
    // A completion whose request was dropped while it committed is in the table, not always
    // in the counters: the table is the truth.
    let outcomes = store.outcomes().await;
    assert_eq!(outcomes.len(), CHARGES);
    assert!(
        outcomes.iter().all(|(_, status, _)| status == "completed"),
        "{outcomes:?}"
    );
    assert!(counts.completions <= CHARGES as u64);
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_every_charge_happens_once_through_a_lossy_link() {
    every_charge_happens_once_through_a_lossy_link::<safe_retry_server::SqliteStore>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_every_charge_happens_once_through_a_lossy_link() {
    every_charge_happens_once_through_a_lossy_link::<safe_retry_server::PostgresStore>().await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_every_charge_happens_once_through_a_lossy_link() {
    every_charge_happens_once_through_a_lossy_link::<safe_retry_server::MySqlStore>().await;
}
