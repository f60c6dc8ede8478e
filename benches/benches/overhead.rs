//! Time per request: the clients of the success path ((a) to (f), see the crate docs)
//! and the retry path of (c) and (d), with criterion; then an interleaved run for the ratios.
//!
//! Client and server share one current-thread runtime, as in the instruction-count bench.
//! Criterion measures each client on its own; the interleaved run sends a round of requests
//! through every client in turn, round after round (rotating who goes first), so drift in a
//! shared machine hits all alike, and prints the median of the per-round ratios with their
//! interquartile range: on these machines times drift by several percent, so a ratio means
//! little without its spread. Instruction counts (`--bench instructions`) are the steadier
//! figure.
//!
//! Run with `cargo bench -p reqwest-safe-retry-benches --bench overhead`.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use reqwest_safe_retry_benches::{Client, Mode, clients, retrying_clients, run, start};
use tokio::runtime::Runtime;

async fn timed(client: &Client, url: &str, total: u64, in_flight: u64) -> Duration {
    let started = Instant::now();
    run(client, url, total, in_flight).await;
    started.elapsed()
}

fn criterion_groups(c: &mut Criterion, rt: &Runtime, ok: &str, flaky: &str) {
    for in_flight in [1u64, 64] {
        let mut group = c.benchmark_group(format!("success, {in_flight} in flight"));
        for (name, make) in clients() {
            let client = make();
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter_custom(|iters| rt.block_on(timed(&client, ok, iters, in_flight)))
            });
        }
        group.finish();
    }
    let mut group = c.benchmark_group("retry path (a 503, then a 200, no backoff)");
    for (name, make) in retrying_clients() {
        let client = make();
        // Every logical request must meet exactly one 503 and one 200.
        assert_eq!(rt.block_on(client.post(flaky)), 200);
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter_custom(|iters| rt.block_on(timed(&client, flaky, iters, 1)))
        });
    }
    group.finish();
}

/// The `q` quantile (0 to 1) of sorted `values`.
fn quantile(values: &[f64], q: f64) -> f64 {
    values[((values.len() - 1) as f64 * q).round() as usize]
}

/// Every client in turn, `rounds` times, `per_round` POSTs each; prints each client's median
/// time per request, and the median and interquartile range of its per-round ratio to (b) and
/// of (d) to (c).
fn interleaved(rt: &Runtime, url: &str, rounds: usize, per_round: u64, in_flight: u64) {
    let clients: Vec<_> = clients()
        .into_iter()
        .map(|(name, make)| (name, make()))
        .collect();
    for (_, client) in &clients {
        rt.block_on(run(client, url, 256, in_flight));
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); clients.len()];
    for round in 0..rounds {
        for offset in 0..clients.len() {
            let i = (round + offset) % clients.len();
            let took = rt.block_on(timed(&clients[i].1, url, per_round, in_flight));
            times[i].push(took.as_nanos() as f64 / per_round as f64);
        }
    }
    let ratios = |of: usize, to: usize| {
        let mut r: Vec<f64> = (0..rounds).map(|k| times[of][k] / times[to][k]).collect();
        r.sort_by(f64::total_cmp);
        r
    };
    println!(
        "\ninterleaved, {in_flight} in flight: {rounds} rounds of {per_round} POSTs per client"
    );
    println!(
        "{:<24} {:>9} {:>8} {:>17}",
        "client", "µs/req", "vs (b)", "IQR of vs (b)"
    );
    for (i, (name, _)) in clients.iter().enumerate() {
        let mut own = times[i].clone();
        own.sort_by(f64::total_cmp);
        let r = ratios(i, 1);
        println!(
            "{name:<24} {:>9.2} {:>8.3} {:>8.3} - {:.3}",
            quantile(&own, 0.5) / 1000.0,
            quantile(&r, 0.5),
            quantile(&r, 0.25),
            quantile(&r, 0.75)
        );
    }
    let r = ratios(3, 2);
    println!(
        "(d) / (c): median {:.3}, interquartile range {:.3} - {:.3}",
        quantile(&r, 0.5),
        quantile(&r, 0.25),
        quantile(&r, 0.75)
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ok = format!("http://{}/orders", rt.block_on(start(Mode::Ok)));
    let flaky = format!("http://{}/orders", rt.block_on(start(Mode::FailThenOk)));

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    criterion_groups(&mut c, &rt, &ok, &flaky);
    c.final_summary();

    interleaved(&rt, &ok, 31, 400, 1);
    interleaved(&rt, &ok, 31, 3_200, 64);
}
