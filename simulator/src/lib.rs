//! Deterministic simulations of retry traffic through reqwest-safe-retry, in virtual time.
//!
//! A workspace member of its own (`publish = false`), on the library's public API only, so that
//! neither its charting library nor tokio's test clock reaches the library or its users. Run
//! `cargo run --release -p reqwest-safe-retry-simulator -- --out docs/img` to write the figures
//! `docs/simulations.md` shows.
//!
//! A simulation drives open-loop traffic (requests arrive at a fixed rate whether or not earlier
//! ones finished, as they do from a fleet of independent callers) through the real
//! [`RetryMiddleware`], with its real backoff, `Retry-After` handling and [`RetryBudget`], against
//! a scripted service at the end of the middleware chain. Time is tokio's paused clock, on a
//! clock whose per-attempt timeouts are tokio timers too: with no socket anywhere, everything,
//! timeouts included, happens in virtual time; minutes of traffic take a moment, and the same
//! seed gives the same report.
//!
//! Four scenarios, each with a report and a chart (see [`figures`]):
//!
//! - [`Contention`]: clients racing for a resource that takes one write at a time, under four
//!   jitter strategies;
//! - [`OpenLoop`]: open-loop traffic through an outage and back, with and without a budget;
//! - [`Herd`]: many clients told to come back at the same instant by `Retry-After`;
//! - [`Layers`]: retrying layers stacked over a dead backend, with and without the one-layer rule.
//!
//! ```
//! use std::time::Duration;
//! use reqwest_safe_retry::{RetryBudget, RetryPolicy};
//! use reqwest_safe_retry_simulator::{OpenLoop, Service};
//!
//! let report = OpenLoop {
//!     rate_per_sec: 100,
//!     duration: Duration::from_secs(10),
//!     service: Service::Outage,
//!     policy: RetryPolicy::default(),
//!     budget: Some(RetryBudget::default()),
//!     seed: 1,
//! }
//! .run();
//! assert_eq!(report.logical_requests, 1_000);
//! assert!(report.attempts_per_request() < 1.1);
//! ```

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};

mod chart;
mod contention;
mod figures;
mod herd;
mod latency;
mod layers;
mod metastable;

pub use chart::{Chart, Series, Stroke};
pub use contention::{Contention, ContentionReport, JITTERS, Jitter, jitter_name};
pub use figures::{CONTENTION_SEEDS, Figure, Scale, figures, figures_at};
pub use herd::{Herd, HerdReport};
pub use latency::{DeadConnections, LatencyReport, RATE_PER_SEC, TailAtScale};
pub use layers::{Layers, LayersReport};
pub use metastable::{Clients, Metastable, MetastableReport};

use reqwest_safe_retry::RetryBudget;
use reqwest_safe_retry::RetryPolicy;
use reqwest_safe_retry::{Dependency, RetryMiddleware};
use reqwest_safe_retry::{RandomSource, SeededRng};

/// How the simulated dependency answers each attempt.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Service {
    /// Every attempt gets `503 Service Unavailable`.
    Outage,
    /// Each attempt independently gets `503` with probability `failure_rate`, else `200`.
    Healthy {
        /// The probability, from 0 to 1, that an attempt fails.
        failure_rate: f64,
    },
    /// `503` to every attempt from `start` until `end` (virtual time since the simulation began),
    /// `200` before and after.
    OutageBetween {
        /// When the outage begins.
        start: Duration,
        /// When it ends.
        end: Duration,
    },
}

/// Open-loop traffic at a fixed rate through one middleware.
#[derive(Debug, Clone)]
pub struct OpenLoop {
    /// Logical requests started per second of virtual time.
    pub rate_per_sec: u32,
    /// How long requests keep arriving.
    pub duration: Duration,
    /// How the dependency answers.
    pub service: Service,
    /// The retry policy under test.
    pub policy: RetryPolicy,
    /// The budget under test; `None` retries without one.
    pub budget: Option<RetryBudget>,
    /// Seeds the jitter and the service's random failures.
    pub seed: u64,
}

/// What a simulation observed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Logical requests sent (calls to `send()`).
    pub logical_requests: u64,
    /// Attempts that reached the service, retries included.
    pub attempts: u64,
    /// Logical requests whose final answer was a success.
    pub succeeded: u64,
    /// Attempts that reached the service in each second of virtual time.
    pub attempts_per_second: Vec<u64>,
    /// Retries the budget refused.
    pub budget_refusals: u64,
}

impl Report {
    /// Attempts per logical request: 1.0 means no retries reached the service.
    pub fn attempts_per_request(&self) -> f64 {
        self.attempts as f64 / self.logical_requests.max(1) as f64
    }

    /// The share of logical requests that succeeded, from 0 to 1.
    pub fn success_rate(&self) -> f64 {
        self.succeeded as f64 / self.logical_requests.max(1) as f64
    }
}

impl OpenLoop {
    /// Runs the simulation to the end (every request finished) and reports.
    ///
    /// # Panics
    ///
    /// If a tokio runtime cannot be built, or `rate_per_sec` is 0.
    pub fn run(&self) -> Report {
        assert!(self.rate_per_sec > 0, "rate_per_sec must be at least 1");
        block_on_paused(self.drive())
    }

    async fn drive(&self) -> Report {
        let service = self.service;
        let failures = SeededRng::new(self.seed ^ 0x5EED_5E41_11CE);
        let backend = Arc::new(Backend::new(move |at: Duration| {
            let fails = match service {
                Service::Outage => true,
                Service::Healthy { failure_rate } => {
                    (failures.next_u64() as f64 / u64::MAX as f64) < failure_rate
                }
                Service::OutageBetween { start, end } => (start..end).contains(&at),
            };
            (if fails { 503 } else { 200 }, None)
        }));
        let dependency = Dependency::new("service", self.policy);
        let dependency = match &self.budget {
            Some(budget) => dependency.with_budget(budget.clone()),
            None => dependency.without_budget(),
        };
        let middleware = RetryMiddleware::new(dependency.clone())
            .with_clock(VirtualTime)
            .with_rng(SeededRng::new(self.seed));
        let client = client_with(middleware, backend.clone());

        let total = u64::from(self.rate_per_sec).saturating_mul(self.duration.as_secs())
            + u64::from(self.rate_per_sec) * u64::from(self.duration.subsec_millis()) / 1000;
        let mut tasks = offer(&client, total, self.rate_per_sec).await;
        let mut succeeded = 0;
        while let Some(done) = tasks.join_next().await {
            succeeded += u64::from(done.is_ok_and(|(ok, _, _)| ok));
        }
        let mut attempts_per_second = Vec::new();
        for at in backend.arrivals() {
            let second = usize::try_from(at.as_secs()).unwrap_or(usize::MAX);
            if attempts_per_second.len() <= second {
                attempts_per_second.resize(second + 1, 0);
            }
            attempts_per_second[second] += 1;
        }
        Report {
            logical_requests: total,
            attempts: attempts_per_second.iter().sum(),
            succeeded,
            attempts_per_second,
            budget_refusals: dependency.counters().budget_refusals,
        }
    }
}

/// The simulations' clock: tokio's, paused, for sleeps and timeouts alike. Unlike
/// [`TokioClock`](reqwest_safe_retry::TokioClock), which measures per-attempt timeouts in real time under a
/// paused clock (a real server needs real time to answer), this one lets tokio jump to them: the
/// simulated backend does no I/O, so nothing but virtual time can be waiting.
#[derive(Debug, Clone, Copy)]
struct VirtualTime;

impl reqwest_safe_retry::Clock for VirtualTime {
    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }

    fn wall_now(&self) -> std::time::SystemTime {
        std::time::SystemTime::now()
    }

    fn sleep(&self, duration: Duration) -> reqwest_safe_retry::Sleep {
        Box::pin(tokio::time::sleep(duration))
    }

    fn timeout(&self, duration: Duration) -> reqwest_safe_retry::Sleep {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// Runs `future` on a current-thread runtime whose clock starts paused: time moves only when
/// every task waits, straight to the next timer.
fn block_on_paused<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime with a paused clock")
        .block_on(future)
}

/// A client: `middleware`, then the simulated `backend` at the end of the chain.
fn client_with(
    middleware: RetryMiddleware,
    backend: Arc<dyn Middleware>,
) -> reqwest_middleware::ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .with_arc(backend)
        .build()
}

/// Sends `total` logical GETs through `client`, `rate_per_sec` a second on a fixed schedule
/// (open loop: whether earlier ones finished or not); each task answers whether its request
/// succeeded, when it was sent and when it finished (both since the first was sent).
async fn offer(
    client: &reqwest_middleware::ClientWithMiddleware,
    total: u64,
    rate_per_sec: u32,
) -> tokio::task::JoinSet<(bool, Duration, Duration)> {
    let interval = Duration::from_secs(1) / rate_per_sec.max(1);
    let started = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        let at = started + interval * u32::try_from(i).unwrap_or(u32::MAX);
        tokio::time::sleep_until(at).await;
        let client = client.clone();
        tasks.spawn(async move {
            let sent = started.elapsed();
            let ok = matches!(
                client.get("http://127.0.0.1:9/").send().await,
                Ok(response) if response.status().is_success()
            );
            (ok, sent, started.elapsed())
        });
    }
    tasks
}

/// A response of `status` with an empty body and, maybe, a `Retry-After`.
fn answer(status: u16, retry_after: Option<String>) -> Response {
    let mut response = http::Response::builder().status(status);
    if let Some(value) = retry_after {
        response = response.header(http::header::RETRY_AFTER, value);
    }
    let response = response
        .body(Vec::new())
        .unwrap_or_else(|_| unreachable!("a status and an empty body make a response"));
    Response::from(response)
}

/// Records that an attempt arrived, and returns when: time since `started`.
fn arrive(started: tokio::time::Instant, arrivals: &Mutex<Vec<Duration>>) -> Duration {
    let at = started.elapsed();
    arrivals.lock().unwrap_or_else(|e| e.into_inner()).push(at);
    at
}

/// The answer a [`Backend`] gives: a status and, maybe, a `Retry-After` value.
type Answer = (u16, Option<String>);

/// A simulated server at the end of the chain: answers by the time of arrival, records every
/// arrival, and does no I/O.
struct Backend<F> {
    answer: F,
    started: tokio::time::Instant,
    arrivals: Mutex<Vec<Duration>>,
}

impl<F: Fn(Duration) -> Answer + Send + Sync + 'static> Backend<F> {
    fn new(answer: F) -> Self {
        Backend {
            answer,
            started: tokio::time::Instant::now(),
            arrivals: Mutex::new(Vec::new()),
        }
    }

    fn arrivals(&self) -> Vec<Duration> {
        self.arrivals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[async_trait::async_trait]
impl<F: Fn(Duration) -> Answer + Send + Sync + 'static> Middleware for Backend<F> {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let at = arrive(self.started, &self.arrivals);
        let (status, retry_after) = (self.answer)(at);
        Ok(answer(status, retry_after))
    }
}
