//! The driver under random scripts: one to three nested instances with their own policies,
//! budgets and counters, a scripted backend at the end of the chain (no sockets: each attempt
//! takes scripted virtual time and answers a scripted status), and the caller dropping the
//! request after a random number of polls, so during an attempt, a wait or anywhere else.
//!
//! Checked on each script, with its seed named on failure: the backend sees at most the
//! outermost instance's attempts; the inner instances count nothing; the tokens the budget paid
//! equal the retries that started; the counters equal what the backend saw; a finished request's
//! record agrees; the same seed gives the same run.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant, SystemTime};

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use reqwest_safe_retry::{
    Clock, CounterSnapshot, Dependency, FakeClock, RetryBudget, RetryError, RetryMiddleware,
    RetryPolicy, RetryRecord, SeededRng, Sleep,
};

/// 1,500 in a debug build (the test command), all 10,000 in release.
const SCRIPTS: u64 = if cfg!(debug_assertions) {
    1_500
} else {
    10_000
};

/// The script generator: the crate's own seeded source, a public SplitMix64.
struct Gen(SeededRng);

impl Gen {
    fn new(seed: u64) -> Gen {
        Gen(SeededRng::new(seed))
    }

    fn next(&mut self) -> u64 {
        reqwest_safe_retry::RandomSource::next_u64(&self.0)
    }

    fn upto(&mut self, n: u64) -> u64 {
        self.next() % (n + 1)
    }
}

/// Yields once: a suspension point, as real I/O or a real timer would give.
struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// A `FakeClock` whose sleeps suspend once, so a caller can drop the request mid-wait.
#[derive(Debug, Clone)]
struct Suspending(FakeClock);

impl Clock for Suspending {
    fn now(&self) -> Instant {
        self.0.now()
    }
    fn wall_now(&self) -> SystemTime {
        self.0.wall_now()
    }
    fn sleep(&self, duration: Duration) -> Sleep {
        let sleep = self.0.sleep(duration);
        Box::pin(async move {
            sleep.await;
            YieldOnce(false).await;
        })
    }
    fn timeout(&self, duration: Duration) -> Sleep {
        self.0.timeout(duration)
    }
}

#[derive(Debug, Clone, Copy)]
struct Step {
    status: u16,
    retry_after: Option<u64>,
    takes: Duration,
}

/// The backend: each attempt moves virtual time by its scripted duration, suspends once (so a
/// timeout that time has reached is seen), then answers.
#[derive(Debug)]
struct Backend {
    clock: FakeClock,
    steps: Mutex<VecDeque<Step>>,
    arrivals: Mutex<u64>,
}

#[async_trait::async_trait]
impl Middleware for Backend {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        *self.arrivals.lock().unwrap() += 1;
        let step = self.steps.lock().unwrap().pop_front().unwrap_or(Step {
            status: 503,
            retry_after: None,
            takes: Duration::ZERO,
        });
        self.clock.advance(step.takes);
        YieldOnce(false).await;
        let mut response = http::Response::builder().status(step.status);
        if let Some(secs) = step.retry_after {
            response = response.header("retry-after", secs.to_string());
        }
        Ok(Response::from(response.body("").unwrap()))
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    arrivals: u64,
    sleeps: Vec<Duration>,
    /// `None` when the caller dropped the request; otherwise the status and the record.
    finished: Option<(u16, u32)>,
    counts: Vec<CounterSnapshot>,
    budget_retries: u64,
    balance: u64,
}

fn run(seed: u64, http: &reqwest::Client) -> (Outcome, u32) {
    let mut g = Gen::new(seed);
    let clock = FakeClock::new();
    let layers = 1 + g.upto(2) as usize;
    let mut outer_max = 0;
    let mut builder = ClientBuilder::new(http.clone());
    let mut counters = Vec::new();
    let mut outer_budget = None;
    for layer in 0..layers {
        let max_attempts = 1 + g.upto(3) as u32;
        let policy = RetryPolicy::builder()
            .max_attempts(max_attempts)
            .base_delay(Duration::from_millis(g.upto(99)))
            .max_delay(Duration::from_secs(2))
            .attempt_timeout(Duration::from_millis(20 + g.upto(3_000)))
            .deadline(Duration::from_millis(100 + g.upto(10_000)))
            .build()
            .unwrap();
        let capacity = 2 + g.upto(3);
        let budget = RetryBudget::builder()
            .capacity(capacity as f64)
            .initial(g.upto(capacity) as f64)
            .floor_per_sec(0.0)
            .build()
            .unwrap();
        let dependency = Dependency::new("default", policy).with_budget(budget.clone());
        let middleware = RetryMiddleware::new(dependency.clone())
            .with_clock(Suspending(clock.clone()))
            .with_rng(SeededRng::new(seed ^ layer as u64));
        counters.push(dependency);
        if layer == 0 {
            outer_max = max_attempts;
            outer_budget = Some(budget);
        }
        builder = builder.with(middleware);
    }
    let steps: VecDeque<Step> = (0..6)
        .map(|_| Step {
            status: [200, 503, 503, 429, 404, 503][g.upto(5) as usize],
            retry_after: (g.upto(3) == 0).then(|| g.upto(3)),
            takes: Duration::from_millis(if g.upto(5) == 0 {
                g.upto(4_000)
            } else {
                g.upto(50)
            }),
        })
        .collect();
    let backend = Arc::new(Backend {
        clock: clock.clone(),
        steps: Mutex::new(steps),
        arrivals: Mutex::new(0),
    });
    let client = builder.with_arc(backend.clone()).build();
    // Dropped after this many polls; most requests run to the end.
    let polls = if g.upto(2) == 0 {
        u64::MAX
    } else {
        1 + g.upto(6)
    };

    // Boxed, so that dropping it below really drops the request.
    let mut send = Box::pin(client.get("http://127.0.0.1:9/script").send());
    let mut cx = Context::from_waker(Waker::noop());
    let mut finished = None;
    // Bounded: every suspension in this chain is a single yield.
    for _ in 0..polls.min(1_000) {
        if let Poll::Ready(result) = send.as_mut().poll(&mut cx) {
            finished = Some(match result {
                Ok(response) => (
                    response.status().as_u16(),
                    RetryRecord::of(&response).unwrap().attempts(),
                ),
                // A timed-out last attempt: status 0 stands for "an error".
                Err(err) => (0, RetryError::of(&err).unwrap().attempts()),
            });
            break;
        }
    }
    assert!(
        finished.is_some() || polls < 1_000,
        "seed {seed}: not finished after 1,000 polls"
    );
    drop(send);
    let budget = outer_budget.unwrap();
    let arrivals = *backend.arrivals.lock().unwrap();
    let outcome = Outcome {
        arrivals,
        sleeps: clock.sleeps(),
        finished,
        counts: counters.iter().map(Dependency::counters).collect(),
        budget_retries: counters[0].counters().retries,
        balance: (budget.balance() * 1000.0).round() as u64,
    };
    (outcome, outer_max)
}

#[test]
fn nested_instances_and_dropped_requests_keep_every_count_true() {
    let http = reqwest::Client::new();
    let (mut dropped, mut dropped_waiting, mut nested) = (0, 0, 0);
    for seed in 0..SCRIPTS {
        let (got, outer_max) = run(seed, &http);
        let outer = got.counts[0];
        assert!(
            got.arrivals <= u64::from(outer_max),
            "seed {seed}: {} attempts, the outermost allows {outer_max}",
            got.arrivals
        );
        for (layer, inner) in got.counts.iter().enumerate().skip(1) {
            assert_eq!(
                *inner,
                CounterSnapshot::default(),
                "seed {seed}: inner layer {layer} counted"
            );
        }
        assert_eq!(outer.requests, 1, "seed {seed}");
        assert_eq!(outer.attempts, got.arrivals, "seed {seed}: attempts");
        assert_eq!(outer.retries, got.arrivals.saturating_sub(1), "seed {seed}");
        assert_eq!(
            got.budget_retries, outer.retries,
            "seed {seed}: tokens paid for retries that did not start"
        );
        assert!(got.sleeps.len() as u64 >= outer.retries, "seed {seed}");
        match got.finished {
            Some((_, attempts)) => assert_eq!(u64::from(attempts), got.arrivals, "seed {seed}"),
            None => {
                dropped += 1;
                // A wait began whose retry never did: its token must have come back.
                if got.sleeps.len() as u64 > outer.retries {
                    dropped_waiting += 1;
                }
            }
        }
        if got.counts.len() > 1 {
            nested += 1;
        }
        assert_eq!(run(seed, &http).0, got, "seed {seed}: not reproducible");
    }
    // The scripts reach what they are meant to test.
    assert!(dropped > SCRIPTS / 10, "{dropped} dropped");
    assert!(
        dropped_waiting > SCRIPTS / 100,
        "{dropped_waiting} dropped waiting"
    );
    assert!(nested > SCRIPTS / 2, "{nested} nested");
}
