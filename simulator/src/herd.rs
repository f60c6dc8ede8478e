//! Herd: many clients told `429` with the same `Retry-After` at the same instant.
//!
//! Every client gets `429 Too Many Requests` with `Retry-After: n` at time zero. Without jitter
//! above the floor they all come back at exactly `n` seconds: the server, which asked for room,
//! gets the whole load again in one instant. With it, the backoff's window above the floor spreads
//! them out.

use std::sync::Arc;
use std::time::Duration;

use super::{Backend, VirtualTime, block_on_paused, client_with};
use reqwest_safe_retry::RetryPolicy;
use reqwest_safe_retry::SeededRng;
use reqwest_safe_retry::{Dependency, RetryMiddleware};

/// The herd scenario's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Herd {
    /// Clients, all sending at time zero.
    pub clients: u32,
    /// The `Retry-After` every first attempt gets, in whole seconds; later attempts succeed.
    pub retry_after_secs: u64,
    /// Whether the policy adds the backoff's jitter above the floor.
    pub jitter_above_floor: bool,
    /// Seeds the jitter.
    pub seed: u64,
}

/// What a herd run observed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HerdReport {
    /// Attempts that reached the server in each 10 ms of virtual time, from time zero.
    pub arrivals_per_10ms: Vec<u64>,
}

impl HerdReport {
    /// The most attempts that arrived in any 10 ms after the first instant.
    pub fn peak_retries_per_10ms(&self) -> u64 {
        self.arrivals_per_10ms
            .iter()
            .skip(1)
            .copied()
            .max()
            .unwrap_or(0)
    }
}

impl Herd {
    /// Runs until every client has its answer.
    ///
    /// # Panics
    ///
    /// If a tokio runtime cannot be built.
    pub fn run(&self) -> HerdReport {
        let floor = Duration::from_secs(self.retry_after_secs);
        let header = self.retry_after_secs.to_string();
        let policy = RetryPolicy::builder()
            .retry_after_jitter(self.jitter_above_floor)
            .deadline(
                floor
                    .saturating_mul(2)
                    .saturating_add(Duration::from_secs(10)),
            )
            .max_retry_after(floor.saturating_add(Duration::from_secs(1)))
            .build()
            .expect("a positive deadline and the default statuses make a valid policy");
        // No budget: the herd is about timing, and a budget would let only a few clients retry.
        let middleware = RetryMiddleware::new(Dependency::new("herd", policy).without_budget())
            .with_clock(VirtualTime)
            .with_rng(SeededRng::new(self.seed));
        let clients = self.clients;
        let arrivals = block_on_paused(async {
            // Made inside the paused runtime, so its time zero is the simulation's.
            let backend = Arc::new(Backend::new(move |at: Duration| {
                if at < floor {
                    (429, Some(header.clone()))
                } else {
                    (200, None)
                }
            }));
            let client = client_with(middleware, backend.clone());
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..clients {
                let client = client.clone();
                tasks.spawn(async move { client.get("http://127.0.0.1:9/").send().await.is_ok() });
            }
            while tasks.join_next().await.is_some() {}
            backend.arrivals()
        });
        let mut per_10ms = Vec::new();
        for at in arrivals {
            let bucket = usize::try_from(at.as_millis() / 10).unwrap_or(usize::MAX);
            if per_10ms.len() <= bucket {
                per_10ms.resize(bucket + 1, 0);
            }
            per_10ms[bucket] += 1;
        }
        HerdReport {
            arrivals_per_10ms: per_10ms,
        }
    }
}
