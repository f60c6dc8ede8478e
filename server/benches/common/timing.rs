//! The time benches' common run: latency one request at a time, and throughput with 64
//! concurrent clients on distinct keys beside the floor (the same claim and completion
//! statements sent straight through the store with no HTTP and no layer), on any store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use safe_retry_server::store::{Claim, Completion, StoredAnswer};

use super::Commit;

pub fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Prints both tables for `store`, described as `server` (its name and version).
pub async fn compare<S: Commit>(store: S, server: &str) {
    let (rounds, seconds) = (env("ROUNDS", 5), env("SECONDS", 3));
    println!("{server}, pool of 16, {rounds} rounds; figures are mean [lowest, highest round]");

    println!("\nlatency, one request at a time, 500 requests a round (µs)");
    println!("{:<44} {:>24} {:>24}", "service", "median", "p99");
    for (name, mut router) in [
        ("(a) handler, own transaction", super::bare(store.clone())),
        (
            "(b) the same behind the layer",
            super::layered(store.clone()),
        ),
    ] {
        let mut medians = Vec::new();
        let mut p99s = Vec::new();
        for round in 0..rounds {
            let mut times = Vec::with_capacity(500);
            for i in 0..500 {
                let key = format!("lat-{name}-{round}-{i}");
                let start = Instant::now();
                assert_eq!(super::call(&mut router, &key).await, StatusCode::CREATED);
                times.push(start.elapsed());
            }
            times.sort();
            medians.push(times[times.len() / 2].as_secs_f64() * 1e6);
            p99s.push(times[times.len() * 99 / 100].as_secs_f64() * 1e6);
        }
        println!("{name:<44} {:>24} {:>24}", spread(&medians), spread(&p99s));
    }

    println!("\nthroughput, 64 clients on distinct keys, {seconds} s a round");
    println!(
        "{:<44} {:>24} {:>18} {:>10}",
        "service", "requests/s", "p99 (ms)", "vs floor"
    );
    let floor = throughput(rounds, seconds, {
        let store = store.clone();
        move |key: String| {
            let store = store.clone();
            async move { statements(&store, &key).await }
        }
    })
    .await;
    let mut results = vec![("(f) the layer's statements, no HTTP (floor)", floor)];
    for (name, router) in [
        ("(a) handler, own transaction", super::bare(store.clone())),
        (
            "(b) the same behind the layer",
            super::layered(store.clone()),
        ),
    ] {
        let result = throughput(rounds, seconds, move |key: String| {
            let mut router = router.clone();
            async move { super::call(&mut router, &key).await == StatusCode::CREATED }
        })
        .await;
        results.push((name, result));
    }
    let floor_mean = mean(&results[0].1.0);
    for (name, (rates, p99s)) in &results {
        println!(
            "{name:<44} {:>24} {:>18} {:>10.2}",
            spread(rates),
            spread(p99s),
            mean(rates) / floor_mean
        );
    }
}

/// The floor: what the layer sends for one request, straight through the store: the claim,
/// then the effect and the completion in one transaction.
async fn statements<S: Commit>(store: &S, key: &str) -> bool {
    let fingerprint = [7u8; 32];
    let claim = Claim {
        scope: "",
        key,
        fingerprint: &fingerprint,
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(86400),
    };
    let claimed = store
        .try_claim(&claim)
        .await
        .unwrap()
        .expect("a new key is claimed");
    let mut tx = store.begin().await.unwrap();
    let id = S::record_effect(&mut tx, key, "{\"amount\":1000,\"cur\":\"EU\"}")
        .await
        .unwrap();
    let answer = StoredAnswer {
        status: StatusCode::CREATED,
        headers: vec![(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("text/plain; charset=utf-8"),
        )],
        body: Some(Bytes::from(format!("{{\"effect_id\":{id}}}"))),
    };
    store
        .complete(Some(tx), claimed.fence, &answer)
        .await
        .unwrap()
        == Completion::Completed
}

/// Runs 64 clients for `seconds`, `rounds` times: requests a second and p99 latency (ms) of
/// each round.
pub async fn throughput<F, Fut>(rounds: u64, seconds: u64, one: F) -> (Vec<f64>, Vec<f64>)
where
    F: Fn(String) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    static ROUND: AtomicU64 = AtomicU64::new(0);
    let (mut rates, mut p99s) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let round = ROUND.fetch_add(1, Ordering::Relaxed);
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let clients: Vec<_> = (0..64)
            .map(|client| {
                let (one, stop) = (one.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut times = Vec::new();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let began = Instant::now();
                        assert!(one(format!("tp-{round}-{client}-{i}")).await);
                        times.push(began.elapsed());
                        i += 1;
                    }
                    times
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        stop.store(true, Ordering::Relaxed);
        let mut times = Vec::new();
        for client in clients {
            times.extend(client.await.unwrap());
        }
        let elapsed = start.elapsed().as_secs_f64();
        times.sort();
        rates.push(times.len() as f64 / elapsed);
        p99s.push(times[times.len() * 99 / 100].as_secs_f64() * 1e3);
    }
    (rates, p99s)
}

pub fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

pub fn spread(values: &[f64]) -> String {
    let low = values.iter().cloned().fold(f64::INFINITY, f64::min);
    let high = values.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.0} [{:.0}, {:.0}]", mean(values), low, high)
}
