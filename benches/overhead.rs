//! What the middleware costs per request, next to the alternatives, in one run.
//!
//! A keep-alive HTTP/1.1 server on 127.0.0.1 in the same process answers a small POST through:
//!
//! - (a) a bare `reqwest::Client`;
//! - (b) `reqwest-middleware` with no middleware (the pass-through chain);
//! - (c) `reqwest-retry`'s `RetryTransientMiddleware`, 3 attempts;
//! - (d) this crate's `RetryMiddleware`, default policy (3 attempts), default budget, keys on;
//!   and the same without idempotency keys, to show what a key costs.
//!
//! Criterion measures each one sequentially and with 64 requests in flight, and the retry path
//! (a 503, then a 200, with no backoff) through (c) and (d). Then an interleaved run (every client
//! in turn, round after round, so drift in the machine hits all alike) prints each client's
//! median time per request as a ratio to (a) and (b).
//!
//! Run with `cargo bench --bench overhead`.

#[path = "common/loopback.rs"]
mod loopback;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{RetryBudget, RetryMiddleware, RetryPolicy};
use tokio::runtime::Runtime;

const BODY: &str = "{\"order\":42,\"amount\":1000}";

/// One of the clients under comparison.
#[derive(Clone)]
enum Client {
    Bare(reqwest::Client),
    Chain(ClientWithMiddleware),
}

impl Client {
    async fn post(&self, url: &str) -> u16 {
        let response = match self {
            Client::Bare(c) => c.post(url).body(BODY).send().await.unwrap(),
            Client::Chain(c) => c.post(url).body(BODY).send().await.unwrap(),
        };
        let status = response.status().as_u16();
        response.bytes().await.unwrap();
        status
    }
}

fn reqwest_retry(
    zero_backoff: bool,
) -> reqwest_retry::RetryTransientMiddleware<reqwest_retry::policies::ExponentialBackoff> {
    let mut policy = reqwest_retry::policies::ExponentialBackoff::builder();
    if zero_backoff {
        policy = policy.retry_bounds(Duration::ZERO, Duration::ZERO);
    }
    reqwest_retry::RetryTransientMiddleware::new_with_policy(policy.build_with_max_retries(2))
}

fn clients() -> Vec<(&'static str, Client)> {
    vec![
        ("(a) bare reqwest", Client::Bare(reqwest::Client::new())),
        (
            "(b) pass-through chain",
            Client::Chain(ClientBuilder::new(reqwest::Client::new()).build()),
        ),
        (
            "(c) reqwest-retry",
            Client::Chain(
                ClientBuilder::new(reqwest::Client::new())
                    .with(reqwest_retry(false))
                    .build(),
            ),
        ),
        (
            "(d) reqwest-safe-retry",
            Client::Chain(
                ClientBuilder::new(reqwest::Client::new())
                    .with(RetryMiddleware::new(RetryPolicy::default()))
                    .build(),
            ),
        ),
        (
            "(d) without keys",
            Client::Chain(
                ClientBuilder::new(reqwest::Client::new())
                    .with(RetryMiddleware::new(RetryPolicy::default()).without_idempotency_keys())
                    .build(),
            ),
        ),
    ]
}

/// Sends `total` POSTs, `in_flight` at a time; returns the wall time.
async fn run(client: &Client, url: &str, total: u64, in_flight: u64) -> Duration {
    let start = Instant::now();
    if in_flight <= 1 {
        for _ in 0..total {
            client.post(url).await;
        }
    } else {
        let mut tasks = tokio::task::JoinSet::new();
        for worker in 0..in_flight {
            let (client, url) = (client.clone(), url.to_owned());
            let share = total / in_flight + u64::from(worker < total % in_flight);
            tasks.spawn(async move {
                for _ in 0..share {
                    client.post(&url).await;
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }
    start.elapsed()
}

fn success_path(c: &mut Criterion, rt: &Runtime, addr: SocketAddr) {
    let url = format!("http://{addr}/orders");
    for in_flight in [1u64, 64] {
        let mut group = c.benchmark_group(format!("overhead/success, {in_flight} in flight"));
        for (name, client) in clients() {
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter_custom(|iters| rt.block_on(run(&client, &url, iters, in_flight)))
            });
        }
        group.finish();
    }
}

fn retry_path(c: &mut Criterion, rt: &Runtime, addr: SocketAddr) {
    let url = format!("http://{addr}/orders");
    let zero = RetryPolicy::builder()
        .base_delay(Duration::ZERO)
        .max_delay(Duration::ZERO)
        .build()
        .unwrap();
    // A budget that never runs dry here: the bench measures the retry, not a refusal.
    let budget = RetryBudget::builder().capacity(1e12).build().unwrap();
    let retrying = [
        (
            "(c) reqwest-retry",
            ClientBuilder::new(reqwest::Client::new())
                .with(reqwest_retry(true))
                .build(),
        ),
        (
            "(d) reqwest-safe-retry",
            ClientBuilder::new(reqwest::Client::new())
                .with(RetryMiddleware::new(zero).with_budget(budget))
                .build(),
        ),
    ];
    let mut group = c.benchmark_group("overhead/retry path (503, then 200)");
    for (name, client) in retrying {
        let client = Client::Chain(client);
        // Every logical request must meet exactly one 503 and one 200.
        assert_eq!(rt.block_on(client.post(&url)), 200);
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| rt.block_on(run(&client, &url, iters, 1)))
        });
    }
    group.finish();
}

/// Every client in turn, `rounds` times, `per_round` POSTs each (`in_flight` at a time); prints
/// the median time per request of each client and its ratio to (a) and (b).
fn interleaved_ratios(
    rt: &Runtime,
    addr: SocketAddr,
    rounds: usize,
    per_round: u64,
    in_flight: u64,
) {
    let url = format!("http://{addr}/orders");
    let clients = clients();
    for (_, client) in &clients {
        rt.block_on(run(client, &url, 200, in_flight));
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); clients.len()];
    for round in 0..rounds {
        for offset in 0..clients.len() {
            // Rotate the order each round so no client always runs first.
            let i = (round + offset) % clients.len();
            let took = rt.block_on(run(&clients[i].1, &url, per_round, in_flight));
            samples[i].push(took.as_nanos() as f64 / per_round as f64);
        }
    }
    let medians: Vec<f64> = samples
        .iter_mut()
        .map(|s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect();
    println!(
        "\ninterleaved, {in_flight} in flight: {rounds} rounds of {per_round} POSTs per client, \
         median time per request"
    );
    println!(
        "{:<26} {:>10} {:>9} {:>9}",
        "client", "µs", "vs (a)", "vs (b)"
    );
    // Each ratio is of medians taken in the same rounds.
    for ((name, _), median) in clients.iter().zip(&medians) {
        println!(
            "{name:<26} {:>10.2} {:>9.4} {:>9.4}",
            median / 1000.0,
            median / medians[0],
            median / medians[1]
        );
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ok = rt.block_on(loopback::start(loopback::Mode::Ok));
    let flaky = rt.block_on(loopback::start(loopback::Mode::FailThenOk));

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    success_path(&mut c, &rt, ok);
    retry_path(&mut c, &rt, flaky);
    c.final_summary();

    interleaved_ratios(&rt, ok, 41, 400, 1);
    interleaved_ratios(&rt, ok, 41, 4_000, 64);
}
