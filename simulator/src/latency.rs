//! Latency-aware attempts: a tail cut by hedged reads, and dead connections cut by a timeout
//! taken from measured latency.
//!
//! Both drive open-loop GETs through the real middleware against a backend whose attempts take
//! a drawn time (tokio's paused clock: no real waiting) and record each request's latency, from
//! `send()` to its answer.
//!
//! - [`TailAtScale`]: a dependency that answers in 8 to 12 ms, but takes 1 s for 1 % of
//!   attempts, as "The Tail at Scale" (Dean and Barroso, 2013) describes; without hedging and
//!   with it.
//! - [`DeadConnections`]: a dependency that answers in about 10 ms (10 ms times one plus an
//!   exponential draw of mean 0.2), never answers 0.5 % of attempts (a dead connection), and
//!   for 30 s in the middle answers five times slower (a brownout); with the fixed 10 s attempt
//!   timeout and with the timeout taken from latency.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use reqwest_safe_retry::{Dependency, RandomSource, RetryMiddleware, RetryPolicy, SeededRng};

use super::{VirtualTime, answer, block_on_paused, client_with, offer};

/// Requests a second at the standard settings of both scenarios.
pub const RATE_PER_SEC: u32 = 200;

/// The tail scenario: `rate_per_sec` requests a second for `duration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailAtScale {
    /// Requests started per second ([`RATE_PER_SEC`] at the standard settings).
    pub rate_per_sec: u32,
    /// How long requests keep arriving.
    pub duration: Duration,
    /// Whether reads are hedged (after the p95, at most 100 ms).
    pub hedge: bool,
    /// Seeds the latencies and the jitter.
    pub seed: u64,
}

/// The dead connections and brownout scenario: `rate_per_sec` requests a second for
/// `duration`, the brownout from a quarter of it to three quarters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadConnections {
    /// Requests started per second ([`RATE_PER_SEC`] at the standard settings).
    pub rate_per_sec: u32,
    /// How long requests keep arriving.
    pub duration: Duration,
    /// Whether the attempt timeout comes from latency (2 x p99.9, at least 5 ms) rather than
    /// the fixed 10 s.
    pub from_latency: bool,
    /// Seeds the latencies and the jitter.
    pub seed: u64,
}

/// What a latency scenario observed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LatencyReport {
    /// Every request's latency, from `send()` to its answer, sorted.
    pub latencies: Vec<Duration>,
    /// Each request's start (since the first) and latency, in the order they started.
    pub timeline: Vec<(Duration, Duration)>,
    /// Copies that reached the dependency: attempts and hedges.
    pub copies: u64,
    /// Hedges sent.
    pub hedges: u64,
    /// Attempts that arrived during the brownout, if there was one.
    pub brownout_attempts: u64,
    /// Of those, the ones cut by their timeout that would have answered.
    pub brownout_cut: u64,
}

impl LatencyReport {
    /// The `q` quantile (0 to 1) of the requests' latencies.
    pub fn percentile(&self, q: f64) -> Duration {
        let n = self.latencies.len();
        if n == 0 {
            return Duration::ZERO;
        }
        let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
        self.latencies[rank - 1]
    }

    /// Copies beyond one per request, as a share of requests: the extra load.
    pub fn extra_load(&self) -> f64 {
        let requests = self.latencies.len().max(1) as f64;
        (self.copies as f64 - requests) / requests
    }

    /// The share of the brownout's attempts cut by their timeout though they would have
    /// answered.
    pub fn brownout_cut_share(&self) -> f64 {
        self.brownout_cut as f64 / self.brownout_attempts.max(1) as f64
    }
}

/// How long an attempt that arrives at `at` takes (`None`: it never answers).
type Draw = Box<dyn Fn(Duration, &SeededRng) -> Option<Duration> + Send + Sync>;

impl TailAtScale {
    /// Runs every request to its end and reports.
    pub fn run(&self) -> LatencyReport {
        let mut policy = RetryPolicy::builder();
        if self.hedge {
            policy = policy.hedge_reads(0.05, Duration::from_millis(100));
        }
        let policy = policy.build().expect("a valid hedging policy");
        let draw: Draw = Box::new(|_, rng| {
            let u = unit(rng);
            Some(if unit(rng) < 0.01 {
                Duration::from_secs(1)
            } else {
                Duration::from_micros(8_000 + (u * 4_000.0) as u64)
            })
        });
        simulate(
            policy,
            (self.rate_per_sec, self.duration),
            draw,
            None,
            self.seed,
        )
    }
}

impl DeadConnections {
    /// Runs every request to its end and reports.
    pub fn run(&self) -> LatencyReport {
        let mut policy = RetryPolicy::builder();
        if self.from_latency {
            policy = policy.timeout_from_latency(2.0, Duration::from_millis(5));
        }
        let policy = policy.build().expect("a valid latency policy");
        let brownout = (self.duration / 4, self.duration * 3 / 4);
        let draw: Draw = Box::new(move |at, rng| {
            if unit(rng) < 0.005 {
                return None;
            }
            let exponential = -0.2 * (1.0 - unit(rng)).ln();
            let slowdown = if (brownout.0..brownout.1).contains(&at) {
                5.0
            } else {
                1.0
            };
            Some(Duration::from_secs_f64(
                0.010 * (1.0 + exponential) * slowdown,
            ))
        });
        simulate(
            policy,
            (self.rate_per_sec, self.duration),
            draw,
            Some(brownout),
            self.seed,
        )
    }
}

/// A draw from `[0, 1)`.
fn unit(rng: &SeededRng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// One attempt as the backend saw it.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    at: Duration,
    /// It would have answered (it was not a dead connection)...
    answers: bool,
    /// ...and it did, before anything cut it.
    answered: bool,
}

/// A backend whose attempts take a drawn time; it notes which it finished.
struct Timed {
    draw: Draw,
    rng: SeededRng,
    started: tokio::time::Instant,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
}

#[async_trait::async_trait]
impl Middleware for Timed {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let at = self.started.elapsed();
        let took = (self.draw)(at, &self.rng);
        let index = {
            let mut arrivals = self.arrivals.lock().unwrap_or_else(|e| e.into_inner());
            arrivals.push(Arrival {
                at,
                answers: took.is_some(),
                answered: false,
            });
            arrivals.len() - 1
        };
        match took {
            Some(took) => tokio::time::sleep(took).await,
            None => std::future::pending().await,
        }
        // Reached only if nothing cut the attempt (a timeout, or a hedge that won, drops it).
        self.arrivals.lock().unwrap_or_else(|e| e.into_inner())[index].answered = true;
        Ok(answer(200, None))
    }
}

/// Open-loop GETs at `rate_per_sec` for `duration` through `policy` against attempts that
/// take `draw`.
fn simulate(
    policy: RetryPolicy,
    (rate_per_sec, duration): (u32, Duration),
    draw: Draw,
    brownout: Option<(Duration, Duration)>,
    seed: u64,
) -> LatencyReport {
    let dependency = Dependency::new("service", policy);
    let middleware = RetryMiddleware::new(dependency.clone())
        .with_clock(VirtualTime)
        .with_rng(SeededRng::new(seed));
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let total = u64::from(rate_per_sec) * duration.as_secs();
    let timeline = block_on_paused(async {
        let backend = Arc::new(Timed {
            draw,
            rng: SeededRng::new(seed ^ 0x7A11_A75C_A1E5),
            started: tokio::time::Instant::now(),
            arrivals: arrivals.clone(),
        });
        let client = client_with(middleware, backend);
        let mut tasks = offer(&client, total, rate_per_sec).await;
        let mut timeline = Vec::new();
        while let Some(done) = tasks.join_next().await {
            let (_, sent, finished) = done.expect("a request task does not panic");
            timeline.push((sent, finished - sent));
        }
        timeline.sort();
        timeline
    });
    let arrivals = arrivals.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let (mut brownout_attempts, mut brownout_cut) = (0, 0);
    if let Some((start, end)) = brownout {
        for arrival in arrivals.iter().filter(|a| (start..end).contains(&a.at)) {
            brownout_attempts += 1;
            brownout_cut += u64::from(arrival.answers && !arrival.answered);
        }
    }
    let mut latencies: Vec<Duration> = timeline.iter().map(|(_, took)| *took).collect();
    latencies.sort();
    let counters = dependency.counters();
    LatencyReport {
        latencies,
        timeline,
        copies: arrivals.len() as u64,
        hedges: counters.hedges,
        brownout_attempts,
        brownout_cut,
    }
}
