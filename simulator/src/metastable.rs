//! Metastable failure: an overload that outlives its trigger.
//!
//! A dependency of capacity `C` requests a second serves one FIFO queue. Callers give each
//! attempt `attempt_timeout`; an attempt still queued when its caller gives up is abandoned by
//! the caller but not by the server, which still spends its share of capacity on it when its
//! turn comes. Offered load is 0.8 `C`, open loop. A trigger halves the capacity for a while:
//! the queue grows, waits pass the callers' timeout, every attempt is abandoned, and retries add
//! load on top. Whether the dependency comes back when the trigger ends depends on what the
//! clients send while it is down: that is what this scenario compares.
//!
//! It runs the real middleware (its attempt timeouts, retries, budget and throttle) in virtual
//! time against a queue model at the end of the chain; the same seed gives the same report.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use reqwest_safe_retry::{
    AdaptiveThrottle, Dependency, RetryBudget, RetryMiddleware, RetryPolicy, SeededRng,
};

use super::{VirtualTime, answer, arrive, block_on_paused, client_with, offer};

/// What the clients do about failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clients {
    /// One attempt per request.
    NoRetries,
    /// Three attempts, no budget.
    RetriesWithoutBudget,
    /// Three attempts, the default budget.
    RetriesWithBudget,
    /// Three attempts, the default budget and an adaptive throttle.
    BudgetAndThrottle,
}

impl Clients {
    /// All four, in the order of the table.
    pub const ALL: [Clients; 4] = [
        Clients::NoRetries,
        Clients::RetriesWithoutBudget,
        Clients::RetriesWithBudget,
        Clients::BudgetAndThrottle,
    ];

    /// A short name, for tables and legends.
    pub fn name(self) -> &'static str {
        match self {
            Clients::NoRetries => "no retries",
            Clients::RetriesWithoutBudget => "retries, no budget",
            Clients::RetriesWithBudget => "retries, default budget",
            Clients::BudgetAndThrottle => "budget and throttle",
        }
    }
}

/// The metastable scenario's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metastable {
    /// Requests a second the dependency serves when healthy.
    pub capacity: u32,
    /// Logical requests offered a second: 0.8 of the capacity in the standard figure.
    pub offered: u32,
    /// When the capacity is halved, and for how long.
    pub trigger_start: Duration,
    /// How long the capacity stays halved.
    pub trigger_length: Duration,
    /// How long requests keep arriving.
    pub duration: Duration,
    /// Each attempt's timeout.
    pub attempt_timeout: Duration,
    /// What the clients do about failures.
    pub clients: Clients,
    /// The throttle's window, for [`Clients::BudgetAndThrottle`].
    pub throttle_window: Duration,
    /// The throttle's K, for [`Clients::BudgetAndThrottle`].
    pub throttle_k: f64,
    /// Seeds the jitter and the throttle's draws.
    pub seed: u64,
}

impl Metastable {
    /// The standard scenario: capacity 100/s, 80/s offered, capacity halved from 20 s to 30 s,
    /// 120 s of traffic, attempts timed out after 1 s; the throttle's window 2 s, K = 2.
    ///
    /// The throttle's window is short on purpose: a few attempt timeouts, so that it sees the
    /// overload within a second or two and forgets it as soon after. With the default window of
    /// 2 minutes, made for steady traffic, it hardly acts on a 10 s trigger (the dependency then
    /// recovers when the budget alone would let it); with 5 to 10 s it sheds so much, so long,
    /// that it learns of the recovery late (K = 2 lets the admitted share only double per
    /// window).
    pub fn standard(clients: Clients, seed: u64) -> Self {
        Self::at_capacity(100, clients, seed)
    }

    /// The standard scenario at another capacity (offered load 0.8 of it): the same shape with
    /// fewer events, for tests in a debug build.
    pub fn at_capacity(capacity: u32, clients: Clients, seed: u64) -> Self {
        Metastable {
            capacity,
            offered: capacity * 4 / 5,
            trigger_start: Duration::from_secs(20),
            trigger_length: Duration::from_secs(10),
            duration: Duration::from_secs(120),
            attempt_timeout: Duration::from_secs(1),
            clients,
            throttle_window: Duration::from_secs(2),
            throttle_k: 2.0,
            seed,
        }
    }
}

/// What a metastable run observed.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct MetastableReport {
    /// Logical requests that succeeded, by the second they finished in.
    pub goodput_per_second: Vec<u64>,
    /// Attempts that reached the dependency, by the second they arrived in.
    pub arrivals_per_second: Vec<u64>,
    /// Seconds from the end of the trigger until goodput is back to at least 95 % of the
    /// offered load and stays there until the traffic ends; `None` if it never comes back.
    pub recovery: Option<u64>,
}

/// The dependency: one FIFO queue, served at the capacity of the moment.
struct Queue {
    capacity: u32,
    trigger: (Duration, Duration),
    started: tokio::time::Instant,
    /// When the server finishes the work already queued.
    free_at: Mutex<Duration>,
    arrivals: Mutex<Vec<Duration>>,
}

impl Queue {
    /// The time one request takes to serve, starting at `at`.
    fn service_time(&self, at: Duration) -> Duration {
        let capacity = if (self.trigger.0..self.trigger.1).contains(&at) {
            self.capacity / 2
        } else {
            self.capacity
        };
        Duration::from_secs(1) / capacity.max(1)
    }
}

#[async_trait::async_trait]
impl Middleware for Queue {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let at = arrive(self.started, &self.arrivals);
        // The request's turn comes when the work queued before it is done; the server does it
        // whether or not the caller still waits.
        let done = {
            let mut free_at = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
            let start = (*free_at).max(at);
            *free_at = start + self.service_time(start);
            *free_at
        };
        tokio::time::sleep_until(self.started + done).await;
        Ok(answer(200, None))
    }
}

impl Metastable {
    /// Runs the scenario and reports.
    ///
    /// # Panics
    ///
    /// If a tokio runtime cannot be built, or `offered` is 0.
    pub fn run(&self) -> MetastableReport {
        assert!(self.offered > 0, "offered must be at least 1");
        block_on_paused(self.drive())
    }

    async fn drive(&self) -> MetastableReport {
        let trigger_end = self.trigger_start + self.trigger_length;
        let queue = Arc::new(Queue {
            capacity: self.capacity,
            trigger: (self.trigger_start, trigger_end),
            started: tokio::time::Instant::now(),
            free_at: Mutex::new(Duration::ZERO),
            arrivals: Mutex::new(Vec::new()),
        });
        let attempts = if self.clients == Clients::NoRetries {
            1
        } else {
            3
        };
        let policy = RetryPolicy::builder()
            .max_attempts(attempts)
            .attempt_timeout(self.attempt_timeout)
            .deadline(self.attempt_timeout * 10)
            .build()
            .expect("3 attempts of a second within 10 s make a valid policy");
        let dependency = Dependency::new("service", policy);
        let dependency = match self.clients {
            Clients::NoRetries | Clients::RetriesWithoutBudget => dependency.without_budget(),
            Clients::RetriesWithBudget => dependency.with_budget(RetryBudget::default()),
            Clients::BudgetAndThrottle => {
                let throttle = AdaptiveThrottle::builder()
                    .window(self.throttle_window)
                    .k(self.throttle_k)
                    .build()
                    .expect("the scenario's throttle settings are valid");
                dependency
                    .with_budget(RetryBudget::default())
                    .with_throttle(throttle)
            }
        };
        let middleware = RetryMiddleware::new(dependency)
            .with_clock(VirtualTime)
            .with_rng(SeededRng::new(self.seed));
        let client = client_with(middleware, queue.clone());

        let total = u64::from(self.offered) * self.duration.as_secs();
        let mut tasks = offer(&client, total, self.offered).await;
        let seconds = usize::try_from(self.duration.as_secs()).unwrap_or(usize::MAX) + 20;
        let mut goodput = vec![0u64; seconds];
        while let Some(done) = tasks.join_next().await {
            if let Ok((true, _, at)) = done {
                let second = usize::try_from(at.as_secs()).unwrap_or(usize::MAX);
                if let Some(slot) = goodput.get_mut(second) {
                    *slot += 1;
                }
            }
        }
        let mut arrivals = vec![0u64; seconds];
        for at in queue
            .arrivals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let second = usize::try_from(at.as_secs()).unwrap_or(usize::MAX);
            if let Some(slot) = arrivals.get_mut(second) {
                *slot += 1;
            }
        }
        goodput.truncate(usize::try_from(self.duration.as_secs()).unwrap_or(usize::MAX));
        arrivals.truncate(goodput.len());
        let recovery = recovery(&goodput, trigger_end.as_secs(), self.offered);
        MetastableReport {
            goodput_per_second: goodput,
            arrivals_per_second: arrivals,
            recovery,
        }
    }
}

/// Seconds after `trigger_end` from which every second's goodput is at least 95 % of `offered`,
/// to the end of the run (the last second, possibly partial, left out); `None` if none.
fn recovery(goodput: &[u64], trigger_end: u64, offered: u32) -> Option<u64> {
    let floor = u64::from(offered) * 95 / 100;
    let end = goodput.len().saturating_sub(1);
    let from = usize::try_from(trigger_end).ok()?;
    (from..end)
        .find(|&s| goodput[s..end].iter().all(|&g| g >= floor))
        .map(|s| (s - from) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_is_the_first_second_from_which_goodput_holds() {
        let g = [80, 80, 0, 0, 10, 79, 76, 80, 80, 3];
        // Trigger ends at second 2; goodput holds at >= 76 from second 5 on.
        assert_eq!(recovery(&g, 2, 80), Some(3));
        assert_eq!(recovery(&[80, 0, 0, 0], 1, 80), None);
        assert_eq!(recovery(&[80, 80, 80, 80], 1, 80), Some(0));
    }
}
