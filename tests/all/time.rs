//! `Retry-After` and the total deadline, in virtual time (and one real slow server); tokio's
//! paused clock with the default clock; a runtime without tokio's timer.

use std::time::{Duration, Instant, SystemTime};

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    FakeClock, RetryError, RetryMiddleware, RetryPolicy, RetryRecord, SeededRng, StopReason,
};
use wiremock::{MockServer, ResponseTemplate};

use crate::support::{self, Action, RawServer};

/// A server that answers `status` with `Retry-After: value` once, then 200.
async fn once_then_ok(status: u16, value: &str) -> MockServer {
    support::first_then(
        ResponseTemplate::new(status).insert_header("retry-after", value),
        1,
        ResponseTemplate::new(200),
    )
    .await
}

fn client_on(clock: &FakeClock, policy: RetryPolicy, seed: u64) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(policy)
                .with_clock(clock.clone())
                .with_rng(SeededRng::new(seed)),
        )
        .build()
}

/// The jitter above a floor is the first retry's backoff window: [0, 100 ms] by default.
const FIRST_WINDOW: Duration = Duration::from_millis(100);

#[tokio::test]
async fn retry_after_seconds_is_a_floor_with_bounded_jitter_above_it() {
    let mut waits = Vec::new();
    for seed in 0..10 {
        let server = once_then_ok(503, "7").await;
        let clock = FakeClock::new();
        let client = client_on(&clock, support::policy(), seed);

        let response = client.get(server.uri()).send().await.unwrap();

        assert_eq!(response.status(), 200);
        let sleeps = clock.sleeps();
        assert_eq!(sleeps.len(), 1);
        let wait = sleeps[0];
        assert!(wait >= Duration::from_secs(7), "seed {seed}: {wait:?}");
        assert!(
            wait <= Duration::from_secs(7) + FIRST_WINDOW,
            "seed {seed}: {wait:?}"
        );
        waits.push(wait);
    }
    // The jitter is real: clients that got the same header do not all return at once.
    waits.sort();
    waits.dedup();
    assert_eq!(waits.len(), 10);
}

#[tokio::test]
async fn retry_after_http_date_is_read_against_the_fake_wall_clock() {
    let clock = FakeClock::new();
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000);
    clock.set_wall_time(wall);
    let date = httpdate::fmt_http_date(wall + Duration::from_secs(5));
    let server = once_then_ok(429, &date).await;
    let client = client_on(&clock, support::policy(), 1);

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 200);
    let wait = clock.sleeps()[0];
    assert!(wait >= Duration::from_secs(5), "{wait:?}");
    assert!(wait <= Duration::from_secs(5) + FIRST_WINDOW, "{wait:?}");
}

#[tokio::test]
async fn a_retry_after_of_an_hour_returns_the_503_at_once() {
    let server = once_then_ok(503, "3600").await;
    let clock = FakeClock::new();
    let client = client_on(&clock, support::policy(), 1);

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 503);
    assert!(clock.sleeps().is_empty());
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
    let record = RetryRecord::of(&response).unwrap();
    assert_eq!(record.stop_reason(), StopReason::RetryAfterTooLong);
    assert_eq!(record.attempts(), 1);
}

#[tokio::test]
async fn a_retry_after_beyond_the_deadline_returns_at_once() {
    let server = once_then_ok(503, "20").await;
    let clock = FakeClock::new();
    let policy = RetryPolicy::builder()
        .deadline(Duration::from_secs(15))
        .build()
        .unwrap();
    let client = client_on(&clock, policy, 1);

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 503);
    assert!(clock.sleeps().is_empty());
    assert_eq!(
        RetryRecord::of(&response).unwrap().stop_reason(),
        StopReason::RetryAfterTooLong
    );
}

#[tokio::test]
async fn malformed_retry_after_values_fall_back_to_the_backoff() {
    let past = httpdate::fmt_http_date(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000));
    for value in ["-5", "1.5", "", "soon", past.as_str()] {
        let server = once_then_ok(503, value).await;
        let clock = FakeClock::new();
        let client = client_on(&clock, support::policy(), 3);

        let response = client.get(server.uri()).send().await.unwrap();

        assert_eq!(response.status(), 200, "{value:?}");
        let sleeps = clock.sleeps();
        assert_eq!(sleeps.len(), 1, "{value:?}");
        assert!(sleeps[0] <= FIRST_WINDOW, "{value:?}: {:?}", sleeps[0]);
    }
}

/// Valid delta-seconds syntax beyond 64 bits asks for a very large wait (RFC 9111 §1.2.2 reads
/// an overflowing delta-seconds as "very large"): stop now, as for any wait that is too long.
#[tokio::test]
async fn a_retry_after_too_large_for_64_bits_returns_the_503_at_once() {
    let ten_thousand_digits = "9".repeat(10_000);
    for value in ["18446744073709551616", ten_thousand_digits.as_str()] {
        let server = once_then_ok(503, value).await;
        let clock = FakeClock::new();
        let client = client_on(&clock, support::policy(), 1);

        let response = client.get(server.uri()).send().await.unwrap();

        assert_eq!(response.status(), 503, "{} digits", value.len());
        assert!(clock.sleeps().is_empty());
        assert_eq!(server.received_requests().await.unwrap().len(), 1);
        assert_eq!(
            RetryRecord::of(&response).unwrap().stop_reason(),
            StopReason::RetryAfterTooLong
        );
    }
}

#[tokio::test]
async fn a_keyed_409_honours_retry_after() {
    let server = once_then_ok(409, "2").await;
    let clock = FakeClock::new();
    let client = client_on(&clock, support::policy(), 4);

    // The caller's own key, which a crashed earlier run may have sent: its 409 is in flight.
    let post = client
        .post(server.uri())
        .header("idempotency-key", "order-7");
    let response = post.body("x").send().await.unwrap();

    assert_eq!(response.status(), 200);
    assert!(clock.sleeps()[0] >= Duration::from_secs(2));
}

#[tokio::test]
async fn no_wait_starts_that_would_end_past_the_deadline() {
    let server = support::always(503).await;
    let clock = FakeClock::new();
    // Waits at their full ceiling: 1, 2, 4, 8 s... and a 10 s deadline.
    let policy = RetryPolicy::builder()
        .max_attempts(10)
        .base_delay(Duration::from_secs(1))
        .max_delay(Duration::from_secs(60))
        .deadline(Duration::from_secs(10))
        .build()
        .unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(policy)
                .with_clock(clock.clone())
                .with_rng(|| u64::MAX),
        )
        .build();

    let response = client.get(server.uri()).send().await.unwrap();

    // 1 + 2 + 4 = 7 s; the next wait (8 s) would end at 15 s, so it is never started.
    let secs: Vec<u64> = clock.sleeps().iter().map(Duration::as_secs).collect();
    assert_eq!(secs, [1, 2, 4]);
    let record = RetryRecord::of(&response).unwrap();
    assert_eq!(record.stop_reason(), StopReason::DeadlineReached);
    assert_eq!(record.attempts(), 4);
    assert_eq!(server.received_requests().await.unwrap().len(), 4);
}

#[tokio::test]
async fn a_slow_server_is_stopped_by_the_deadline_in_real_time() {
    let unavailable = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n".to_vec();
    let server = RawServer::start(vec![
        Action::Respond(unavailable.clone()),
        Action::Respond(unavailable),
        Action::Delay(Duration::from_secs(10), support::ok("too late")),
    ])
    .await;
    let deadline = Duration::from_millis(200);
    let policy = RetryPolicy::builder()
        .max_attempts(5)
        .base_delay(Duration::from_millis(10))
        .max_delay(Duration::from_millis(20))
        .deadline(deadline)
        .build()
        .unwrap();
    // The real clock: the deadline and the slow server share one timeline.
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy).with_rng(SeededRng::new(5)))
        .build();

    let started = Instant::now();
    let err = client.get(server.url("/")).send().await.unwrap_err();
    let took = started.elapsed();

    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.stop_reason(), StopReason::DeadlineReached, "{retry}");
    assert_eq!(retry.attempts(), 3);
    assert!(retry.timed_out());
    assert!(retry.to_string().contains("deadline reached"), "{retry}");
    assert!(took >= deadline - Duration::from_millis(5), "{took:?}");
    // Far below the 10 s server, with seconds of slack for a loaded machine.
    assert!(took < deadline + Duration::from_secs(3), "{took:?}");
}

/// The way many users test: tokio's clock paused, the default clock, a real server. Backoff
/// takes no real time, and tokio's auto-advance does not cut the attempts waiting for the
/// server.
#[tokio::test(start_paused = true)]
async fn tokio_s_paused_clock_works_with_the_default_clock_against_a_real_server() {
    let server =
        support::first_then(ResponseTemplate::new(503), 2, ResponseTemplate::new(200)).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(RetryPolicy::default()).with_rng(|| u64::MAX))
        .build();

    let (virtual_start, real_start) = (tokio::time::Instant::now(), Instant::now());
    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 200, "{:?}", RetryRecord::of(&response));
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 3);
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
    // The waits (100 ms and 200 ms at their ceiling) passed in virtual time...
    assert!(virtual_start.elapsed() >= Duration::from_millis(300));
    // ...and the attempts were not cut by an auto-advance to their 10 s timeout.
    assert!(virtual_start.elapsed() < Duration::from_secs(10));
    assert!(real_start.elapsed() < Duration::from_secs(5));
}

/// Under a paused clock the per-attempt timeout is tokio's own: a server on the same runtime
/// that sleeps past it is cut at it (in virtual time, after the hold's grace of real time).
#[tokio::test(start_paused = true)]
async fn under_a_paused_clock_the_attempt_timeout_cuts_a_server_that_sleeps_past_it() {
    let slow = Action::Delay(Duration::from_secs(10), support::ok("late"));
    let server = RawServer::start(vec![slow, Action::Respond(support::ok("on time"))]).await;
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(40))
        .build()
        .unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy))
        .build();

    let real_start = Instant::now();
    let response = client.get(server.url("/")).send().await.unwrap();

    assert_eq!(response.text().await.unwrap(), "on time");
    assert_eq!(server.requests(), 2);
    // One cut at 40 ms, not the 10 s server: seconds of slack for a loaded machine.
    assert!(
        real_start.elapsed() < Duration::from_secs(5),
        "{:?}",
        real_start.elapsed()
    );
}

/// A server on a runtime of its own, for a client on a runtime without tokio's timer.
fn server_elsewhere(script: Vec<Action>) -> (RawServer, std::thread::JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            tx.send(RawServer::start(script).await).unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
    });
    (rx.recv().unwrap(), thread)
}

#[test]
fn a_runtime_without_a_timer_works_with_a_fake_clock_and_fails_clearly_with_tokio_s() {
    let (server, _thread) = server_elsewhere(vec![
        Action::Respond(support::unavailable()),
        Action::Respond(support::ok("ok")),
    ]);
    let no_timer = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    no_timer.block_on(async {
        let clock = FakeClock::new();
        let client = ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(RetryPolicy::default()).with_clock(clock.clone()))
            .build();
        let response = client.get(server.url("/")).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(server.requests(), 2);
        assert_eq!(clock.sleeps().len(), 1);

        let client = ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(RetryPolicy::default()))
            .build();
        let err = client.get(server.url("/")).send().await.unwrap_err();
        let retry = RetryError::of(&err).unwrap();
        assert_eq!(retry.stop_reason(), StopReason::TimerUnavailable);
        assert_eq!(retry.attempts(), 0);
        assert!(err.to_string().contains("enable_time()"), "{err}");
        assert_eq!(server.requests(), 2, "nothing was sent");
    });
}

/// A server on this runtime: each path's first request is answered `503`, the next `200`,
/// each after a nap of `nap` on tokio's clock (virtual under a paused one).
async fn napping_server(nap: Duration) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                // Bounded: a request head is far shorter than 64 reads.
                for _ in 0..64 {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    head.extend_from_slice(&buf[..n]);
                    if n == 0 || head.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let line = String::from_utf8_lossy(&head)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_owned();
                let path = line.split(' ').nth(1).unwrap_or("").to_owned();
                let first = seen.lock().unwrap().insert(path);
                tokio::time::sleep(nap).await;
                let status = if first {
                    "503 Service Unavailable"
                } else {
                    "200 OK"
                };
                let answer =
                    format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = socket.write_all(answer.as_bytes()).await;
            });
        }
    });
    format!("http://{address}")
}

/// Issue 64, defect 11: many requests retried at once under tokio's paused clock, against a
/// server on the same runtime that waits with `tokio::time::sleep`, are answered in virtual
/// time. Each attempt held tokio's auto-advance for 100 ms of real time, and holds started at
/// different virtual instants ran one after another: 6.4 s of real time for 100 requests. The
/// real time it takes is printed (`--nocapture`); what is checked is what the requests got,
/// and in what virtual time.
#[tokio::test(start_paused = true)]
async fn many_requests_retried_at_once_on_the_paused_clock_are_answered_in_virtual_time() {
    const REQUESTS: usize = 100;
    let nap = Duration::from_millis(5);
    let server = napping_server(nap).await;
    // Every request retried: a budget would rightly refuse most of a burst of retries.
    let dependency = reqwest_safe_retry::Dependency::new("burst", RetryPolicy::default());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(dependency.without_budget()))
        .build();
    let (virtual_start, real_start) = (tokio::time::Instant::now(), Instant::now());
    let calls = (0..REQUESTS).map(|n| {
        let (client, url) = (client.clone(), format!("{server}/{n}"));
        tokio::spawn(async move { client.get(url).send().await })
    });
    for call in calls.collect::<Vec<_>>() {
        let response = call.await.unwrap().unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    }
    // Two server naps and one backoff (at most 100 ms): no attempt was cut at its timeout.
    let took = virtual_start.elapsed();
    assert!(took >= 2 * nap && took < Duration::from_secs(1), "{took:?}");
    eprintln!(
        "{REQUESTS} requests retried at once: {took:?} of virtual time, {:?} of real time",
        real_start.elapsed()
    );
}

/// Issue 64, defect 11: after its runtime learned short holds from a server that answers in
/// virtual time, an attempt to a server elsewhere (its own runtime and thread, real time) is
/// still given the whole grace: its timer, reached at once by auto-advance, waits the rest of
/// 100 ms of real time, and the answer that comes within it is taken (cut three times before,
/// without that wait). Virtual time has moved to the attempt's timeout meanwhile.
#[tokio::test(start_paused = true)]
async fn after_short_holds_a_server_elsewhere_still_has_the_whole_grace_to_answer() {
    let server = napping_server(Duration::from_secs(1)).await;
    let dependency = reqwest_safe_retry::Dependency::new("learn", RetryPolicy::default());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(dependency.without_budget()))
        .build();
    // Each of these attempts waits for the server's nap in virtual time: its hold runs out.
    for n in 0..4 {
        let response = client.get(format!("{server}/{n}")).send().await.unwrap();
        assert_eq!(response.status(), 200);
    }
    let (elsewhere, _thread) = server_elsewhere(vec![Action::Delay(
        Duration::from_millis(10),
        support::ok("from elsewhere"),
    )]);
    let virtual_start = tokio::time::Instant::now();
    let response = client.get(elsewhere.url("/")).send().await.unwrap();
    assert_eq!(response.text().await.unwrap(), "from elsewhere");
    assert_eq!(elsewhere.requests(), 1);
    assert_eq!(
        virtual_start.elapsed(),
        Duration::from_secs(10),
        "the attempt's timeout"
    );
}
