//! Properties of the schedule over random scripts of responses, `Retry-After` values (in
//! seconds, dates and the millisecond fields) and settings, in virtual time.
//!
//! A scripted middleware at the end of the chain stands in for the network: each attempt takes
//! a scripted time on the fake clock (cut, as the middleware cuts it on the wire, at the smaller
//! of the attempt timeout and what the deadline leaves; a cut attempt answers 504), and
//! answers a scripted status and `Retry-After`. No sockets: 10,000 logical requests run in a
//! few seconds, and every timing is exact.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::Extensions;
use proptest::prelude::*;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use reqwest_safe_retry::{Clock, FakeClock, RetryMiddleware, RetryPolicy, SeededRng};

#[derive(Debug, Clone)]
enum RetryAfter {
    None,
    Seconds(u64),
    /// An HTTP-date this many seconds from the fake wall clock (negative: in the past).
    DateAhead(i64),
    Garbage(&'static str),
    /// `retry-after-ms`, or Azure's `x-ms-retry-after-ms` (true), in milliseconds.
    Millis(u64, bool),
    /// `retry-after-ms` beside a `Retry-After` in seconds: the milliseconds win.
    MillisOverSeconds(u64, u64),
    /// A `retry-after-ms` that is not valid beside a `Retry-After`: the seconds count.
    GarbageMillisOverSeconds(&'static str, u64),
}

#[derive(Debug, Clone)]
struct Step {
    status: u16,
    retry_after: RetryAfter,
    takes: Duration,
}

/// What the scripted network saw of one attempt, in virtual time since the request began.
#[derive(Debug, Clone)]
struct Seen {
    start: Duration,
    end: Duration,
    /// The floor the answer asked for, if its `Retry-After` was valid.
    floor: Option<Duration>,
}

#[derive(Debug)]
struct Script {
    clock: FakeClock,
    origin: std::time::Instant,
    /// The policy's attempt timeout and deadline: the middleware cuts each attempt at the
    /// smaller of the timeout and what the deadline leaves, on the wire; the script, standing
    /// in for the wire, does the same in virtual time.
    attempt_timeout: Duration,
    deadline: Duration,
    steps: Mutex<VecDeque<Step>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

#[async_trait::async_trait]
impl Middleware for Script {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let start = self.clock.now() - self.origin;
        let step = self.steps.lock().unwrap().pop_front().unwrap_or(Step {
            status: 503,
            retry_after: RetryAfter::None,
            takes: Duration::ZERO,
        });
        let timeout = self
            .attempt_timeout
            .min(self.deadline.saturating_sub(start));
        let timed_out = step.takes > timeout;
        self.clock.advance(step.takes.min(timeout));
        let end = self.clock.now() - self.origin;
        let wall = self.clock.wall_now();

        let mut response =
            http::Response::builder().status(if timed_out { 504 } else { step.status });
        let mut floor = None;
        if !timed_out {
            let value = match step.retry_after {
                RetryAfter::None => None,
                RetryAfter::Millis(ms, azure) => {
                    floor = Some(Duration::from_millis(ms));
                    let name = if azure {
                        "x-ms-retry-after-ms"
                    } else {
                        "retry-after-ms"
                    };
                    response = response.header(name, ms.to_string());
                    None
                }
                RetryAfter::MillisOverSeconds(ms, s) => {
                    floor = Some(Duration::from_millis(ms));
                    response = response.header("retry-after-ms", ms.to_string());
                    Some(s.to_string())
                }
                RetryAfter::GarbageMillisOverSeconds(g, s) => {
                    floor = Some(Duration::from_secs(s));
                    response = response.header("retry-after-ms", g);
                    Some(s.to_string())
                }
                RetryAfter::Seconds(s) => {
                    floor = Some(Duration::from_secs(s));
                    Some(s.to_string())
                }
                RetryAfter::DateAhead(ahead) => {
                    let date = if ahead >= 0 {
                        wall + Duration::from_secs(ahead as u64)
                    } else {
                        wall - Duration::from_secs(ahead.unsigned_abs())
                    };
                    let text = httpdate::fmt_http_date(date);
                    // The header has whole seconds: the floor is what it says, not what we meant.
                    let said = httpdate::parse_http_date(&text).unwrap();
                    floor = Some(said.duration_since(wall).unwrap_or(Duration::ZERO));
                    Some(text)
                }
                RetryAfter::Garbage(g) => Some(g.to_owned()),
            };
            if let Some(value) = value {
                response = response.header("retry-after", value);
            }
        }
        self.seen.lock().unwrap().push(Seen { start, end, floor });
        Ok(Response::from(response.body("").unwrap()))
    }
}

fn retry_after() -> impl Strategy<Value = RetryAfter> {
    prop_oneof![
        3 => Just(RetryAfter::None),
        3 => (0u64..90).prop_map(RetryAfter::Seconds),
        1 => Just(RetryAfter::Seconds(3600)),
        2 => (-30i64..90).prop_map(RetryAfter::DateAhead),
        1 => prop_oneof![Just("-1"), Just("1.5"), Just(""), Just("later"), Just("9 9")]
            .prop_map(RetryAfter::Garbage),
        2 => (0u64..90_000, any::<bool>()).prop_map(|(ms, azure)| RetryAfter::Millis(ms, azure)),
        1 => (0u64..5_000, 0u64..90).prop_map(|(ms, s)| RetryAfter::MillisOverSeconds(ms, s)),
        1 => (
            prop_oneof![Just("-1"), Just("1e3"), Just("soon"), Just("1."), Just("")],
            0u64..90,
        )
            .prop_map(|(g, s)| RetryAfter::GarbageMillisOverSeconds(g, s)),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    (
        prop_oneof![
            Just(200u16),
            Just(429),
            Just(502),
            Just(503),
            Just(503),
            Just(504),
            Just(500)
        ],
        retry_after(),
        prop_oneof![3 => 0u64..2_000, 1 => 0u64..40_000].prop_map(Duration::from_millis),
    )
        .prop_map(|(status, retry_after, takes)| Step {
            status,
            retry_after,
            takes,
        })
}

#[derive(Debug, Clone)]
struct Settings {
    max_attempts: u32,
    base: Duration,
    cap: Duration,
    attempt_timeout: Duration,
    deadline: Duration,
    max_retry_after: Duration,
    seed: u64,
}

fn settings() -> impl Strategy<Value = Settings> {
    (
        1u32..10,
        0u64..3_000,
        0u64..60_000,
        100u64..20_000,
        1_000u64..120_000,
        0u64..120,
        any::<u64>(),
    )
        .prop_map(
            |(max_attempts, base, extra, timeout, deadline, max_ra, seed)| Settings {
                max_attempts,
                // Valid policies only: the base below the deadline, and no longer
                // Retry-After allowed than the deadline.
                base: Duration::from_millis(base.min(deadline - 1)),
                cap: Duration::from_millis(base.min(deadline - 1) + extra),
                attempt_timeout: Duration::from_millis(timeout),
                deadline: Duration::from_millis(deadline),
                max_retry_after: Duration::from_secs(max_ra).min(Duration::from_millis(deadline)),
                seed,
            },
        )
}

/// Runs one logical request through the middleware and the script; returns what the script saw,
/// the recorded sleeps and the virtual time at the stop.
fn run(settings: &Settings, steps: Vec<Step>) -> (Vec<Seen>, Vec<Duration>, Duration) {
    let clock = FakeClock::new();
    clock.set_wall_time(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000));
    let origin = clock.now();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let policy = RetryPolicy::builder()
        .max_attempts(settings.max_attempts)
        .base_delay(settings.base)
        .max_delay(settings.cap)
        .attempt_timeout(settings.attempt_timeout)
        .deadline(settings.deadline)
        .max_retry_after(settings.max_retry_after)
        .build()
        .unwrap();
    let http = HTTP.with(Clone::clone);
    let client = ClientBuilder::new(http)
        .with(
            RetryMiddleware::new(policy)
                .with_clock(clock.clone())
                .with_rng(SeededRng::new(settings.seed)),
        )
        .with(Script {
            clock: clock.clone(),
            origin,
            attempt_timeout: settings.attempt_timeout,
            deadline: settings.deadline,
            steps: Mutex::new(steps.into()),
            seen: seen.clone(),
        })
        .build();
    RUNTIME.with(|rt| {
        rt.block_on(async {
            client.get("http://127.0.0.1:9/").send().await.unwrap();
        })
    });
    let seen = seen.lock().unwrap().clone();
    (seen, clock.sleeps(), clock.now() - origin)
}

thread_local! {
    // One reqwest client per thread, cloned per case: building one can cost milliseconds (with
    // a TLS backend, it loads the system's root certificates), ten thousand times over.
    static HTTP: reqwest::Client = reqwest::Client::new();
    // Timers on: the middleware enforces each attempt's timeout on tokio's timer.
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
}

proptest! {
    // A tenth of the cases in a debug build (the test command), all in release.
    #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 1_000 } else { 10_000 }))]

    #[test]
    fn the_schedule_keeps_the_deadline_and_the_servers_floor(
        settings in settings(),
        steps in proptest::collection::vec(step(), 1..10),
    ) {
        let (seen, sleeps, total) = run(&settings, steps);

        // Attempts are cut to what the deadline leaves, so the stop is never late; the weaker
        // bound (deadline plus one attempt timeout) follows.
        prop_assert!(total <= settings.deadline, "stopped at {total:?}");
        prop_assert!(total <= settings.deadline + settings.attempt_timeout);
        prop_assert!(seen.len() as u32 <= settings.max_attempts);
        prop_assert_eq!(sleeps.len(), seen.len() - 1);
        for (i, sleep) in sleeps.iter().enumerate() {
            let (before, after) = (&seen[i], &seen[i + 1]);
            // Each sleep starts when an attempt ends and the next attempt starts when it ends.
            prop_assert_eq!(after.start, before.end + *sleep);
            // No sleep ends at or after the deadline.
            prop_assert!(after.start < settings.deadline, "sleep {i} ends at {:?}", after.start);
            // No attempt starts earlier than the server's floor.
            if let Some(floor) = before.floor {
                prop_assert!(*sleep >= floor, "slept {sleep:?} under a floor of {floor:?}");
                prop_assert!(floor <= settings.max_retry_after);
                // Nor later than the floor with the widest jitter above it: the field that
                // counts is the one read (milliseconds before seconds).
                prop_assert!(*sleep <= floor + settings.cap, "slept {sleep:?} over a floor of {floor:?}");
            }
        }
    }
}
