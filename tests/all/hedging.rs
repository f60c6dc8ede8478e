//! Hedged reads through the whole chain on loopback, in virtual time: a dependency whose
//! window holds 10 ms answers hedges a read that has waited past its p95, the first answer wins
//! and the server sees the other copy cancelled; no hedge where one is not safe or not paid
//! for; a request dropped with two copies out gives back every token; nested instances hedge
//! once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryBudget, RetryMiddleware, RetryPolicy, RetryRecord, SeededRng,
    StopReason,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::support::{self, Before};

/// A server that holds the first request it gets (it never answers it, and notes when the
/// client closes its connection) and answers every later one at once with 200.
#[derive(Clone)]
pub(crate) struct HoldsTheFirst {
    pub(crate) url: String,
    arrived: Arc<AtomicUsize>,
    /// Connections closed by the client while the server held their request.
    cancelled: Arc<AtomicUsize>,
    /// The request paths, in the order they arrived.
    paths: Arc<Mutex<Vec<String>>>,
    /// The `x-deadline-ms` header of each request, in the order they arrived.
    left: Arc<Mutex<Vec<Option<String>>>>,
}

impl HoldsTheFirst {
    pub(crate) async fn start() -> HoldsTheFirst {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = HoldsTheFirst {
            url: format!("http://{}/items", listener.local_addr().unwrap()),
            arrived: Arc::default(),
            cancelled: Arc::default(),
            paths: Arc::default(),
            left: Arc::default(),
        };
        let shared = server.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let Some(request) = support::read_request(&mut stream).await else {
                        return;
                    };
                    let left = request.header("x-deadline-ms");
                    let left = left.map(|v| String::from_utf8_lossy(v).into_owned());
                    shared.left.lock().unwrap().push(left);
                    shared.paths.lock().unwrap().push(request.path);
                    if shared.arrived.fetch_add(1, Ordering::SeqCst) == 0 {
                        // Held until the client gives up on it: a read of 0 bytes is its close.
                        let mut byte = [0u8; 1];
                        let read = tokio::io::AsyncReadExt::read(&mut stream, &mut byte).await;
                        if matches!(read, Ok(0) | Err(_)) {
                            shared.cancelled.fetch_add(1, Ordering::SeqCst);
                        }
                        return;
                    }
                    let _ = stream.write_all(&support::ok("fast")).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        server
    }

    pub(crate) fn arrived(&self) -> usize {
        self.arrived.load(Ordering::SeqCst)
    }

    pub(crate) fn cancelled(&self) -> usize {
        self.cancelled.load(Ordering::SeqCst)
    }
}

/// The answer to `request`, whose first copy the server holds: only a hedge can answer it,
/// so a request still waiting after 3 s of real time (its hedge takes milliseconds) was not
/// hedged: a failure, not a hang.
async fn hedged_in_time(request: reqwest_middleware::RequestBuilder) -> reqwest::Response {
    tokio::time::timeout(Duration::from_secs(3), request.send())
        .await
        .expect("no hedge answered: the request waits on the held first copy")
        .unwrap()
}

/// Hedges after the p95, at most 1 s; the fixed 5 s timeout.
fn hedging() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(5))
        .hedge_reads(0.05, Duration::from_secs(1))
        .build()
        .unwrap()
}

/// A client of `dependency` on `clock` whose first copy of each request takes `first` of
/// virtual time, and every other copy none.
fn client(dependency: Dependency, clock: &FakeClock, first: Duration) -> ClientWithMiddleware {
    let moved = clock.clone();
    ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(dependency)
                .with_clock(clock.clone())
                .with_rng(SeededRng::new(9)),
        )
        .with(Before(move |extensions: &mut http::Extensions| {
            // The hedge carries a copy of the request's extensions, marked here as seen.
            if extensions.get::<Seen>().is_none() {
                extensions.insert(Seen);
                moved.advance(first);
            }
            None
        }))
        .build()
}

/// Marks the extensions a copy has passed the latency stand-in with.
#[derive(Clone)]
struct Seen;

/// Fills the dependency's window with 150 answers of 10 ms, and lets a second pass so that
/// the window is read again: its p95 is then 10.24 ms (the upper edge of 10 ms's bucket).
async fn fill(dependency: &Dependency, clock: &FakeClock) {
    let server = support::always(200).await;
    let client = client(dependency.clone(), clock, Duration::from_millis(10));
    for _ in 0..150 {
        client.get(server.uri()).send().await.unwrap();
    }
    clock.advance(Duration::from_secs(1));
    assert_eq!(server.received_requests().await.unwrap().len(), 150);
    assert_eq!(dependency.counters().hedges, 0, "none while filling");
}

#[tokio::test]
async fn a_slow_first_copy_is_hedged_after_the_p95_and_the_fast_answer_wins() {
    let clock = FakeClock::new();
    let reads = Dependency::new("reads", hedging());
    fill(&reads, &clock).await;
    let server = HoldsTheFirst::start().await;
    let before = reads.counters();
    // The first copy has waited 50 ms (past the 10.24 ms p95) when it is polled.
    let client = client(reads.clone(), &clock, Duration::from_millis(50));

    let response = hedged_in_time(client.get(&server.url)).await;

    let record = RetryRecord::of(&response).unwrap();
    assert!(record.answered_by_hedge());
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::Succeeded)
    );
    assert_eq!(response.text().await.unwrap(), "fast");
    assert_eq!(server.arrived(), 2);
    let after = reads.counters();
    assert_eq!(
        (
            after.hedges - before.hedges,
            after.hedges_won - before.hedges_won
        ),
        (1, 1)
    );
    assert_eq!(
        after.attempts - before.attempts,
        1,
        "a hedge is not an attempt"
    );
    // The slow copy was dropped, and its connection closed: the server sees it.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while server.cancelled() == 0 {
        assert!(std::time::Instant::now() < deadline, "never cancelled");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(server.cancelled(), 1);
    // No wait was slept: the hedge went on the attempt's own time.
    assert!(clock.sleeps().is_empty(), "{:?}", clock.sleeps());
}

#[tokio::test]
async fn a_first_copy_that_answers_before_the_p95_is_not_hedged() {
    let clock = FakeClock::new();
    let reads = Dependency::new("reads", hedging());
    fill(&reads, &clock).await;
    let server = support::always(200).await;
    let client = client(reads.clone(), &clock, Duration::from_millis(10));

    let response = client.get(server.uri()).send().await.unwrap();

    assert!(!RetryRecord::of(&response).unwrap().answered_by_hedge());
    assert_eq!(reads.counters().hedges, 0);
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

/// Sends one request shaped by `build` through a dependency whose window says hedge after
/// 10.24 ms, with a first copy that waits 50 ms and a server that answers it after 30 ms of
/// real time: how many copies reached the server.
async fn copies_sent(
    dependency: Dependency,
    build: impl FnOnce(&ClientWithMiddleware, &str) -> reqwest_middleware::RequestBuilder,
) -> usize {
    let clock = FakeClock::new();
    fill(&dependency, &clock).await;
    let server = support::RawServer::start(vec![support::Action::Delay(
        Duration::from_millis(30),
        support::ok("slow"),
    )])
    .await;
    let client = client(dependency.clone(), &clock, Duration::from_millis(50));
    let response = build(&client, &server.url("/items")).send().await.unwrap();
    assert!(!RetryRecord::of(&response).unwrap().answered_by_hedge());
    server.requests()
}

#[tokio::test]
async fn no_hedge_for_a_write_a_keyed_read_a_stream_or_a_dry_budget() {
    let reads = || Dependency::new("reads", hedging());
    let post = copies_sent(reads(), |c, url| c.post(url).body("x")).await;
    let keyed = copies_sent(reads(), |c, url| {
        c.get(url).header("idempotency-key", "k-1")
    })
    .await;
    let stream = copies_sent(reads(), |c, url| {
        c.get(url).body(crate::bodies::streaming_body())
    })
    .await;
    // A budget that earns nothing and holds nothing pays for no hedge.
    let dry = RetryBudget::builder()
        .capacity(1.0)
        .initial(0.0)
        .deposit_ratio(0.001)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let broke = copies_sent(reads().with_budget(dry), |c, url| c.get(url)).await;
    assert_eq!((post, keyed, stream, broke), (1, 1, 1, 1));
    // And the same read, hedged, with a budget: two copies.
    let paid = copies_sent(reads(), |c, url| c.get(url)).await;
    assert_eq!(paid, 2);
}

#[tokio::test]
async fn a_read_that_must_not_be_repeated_is_not_hedged() {
    use reqwest_safe_retry::RetryOverride;
    let reads = || Dependency::new("reads", hedging());
    let no_retries = copies_sent(reads(), |c, url| {
        c.get(url).with_extension(RetryOverride::new().no_retries())
    })
    .await;
    let one_attempt = copies_sent(reads(), |c, url| {
        c.get(url)
            .with_extension(RetryOverride::new().max_attempts(1))
    })
    .await;
    let policy = hedging().to_builder().max_attempts(1).build().unwrap();
    let single = copies_sent(Dependency::new("reads", policy), |c, url| c.get(url)).await;
    // A method the policy does not retry is not hedged either.
    let heads_only = (hedging().to_builder())
        .retryable_methods([http::Method::HEAD])
        .build()
        .unwrap();
    let not_retried = copies_sent(Dependency::new("reads", heads_only), |c, url| c.get(url)).await;
    assert_eq!((no_retries, one_attempt, single, not_retried), (1, 1, 1, 1));
}

#[tokio::test]
async fn a_hedge_carries_the_time_left_at_its_own_send() {
    let clock = FakeClock::new();
    let reads = Dependency::new("reads", hedging())
        .with_deadline_header("x-deadline-ms")
        .unwrap();
    fill(&reads, &clock).await;
    let server = HoldsTheFirst::start().await;
    // The first copy goes with the whole 30 s; the hedge 50 ms later on the clock.
    let client = client(reads.clone(), &clock, Duration::from_millis(50));

    let response = hedged_in_time(client.get(&server.url)).await;

    assert!(RetryRecord::of(&response).unwrap().answered_by_hedge());
    let left = server.left.lock().unwrap().clone();
    assert_eq!(left, [Some("30000".to_owned()), Some("29950".to_owned())]);
}

#[tokio::test]
async fn hedges_whose_callers_give_up_stay_paid_for_so_a_dry_budget_stops_them() {
    let clock = FakeClock::new();
    let budget = RetryBudget::builder()
        .capacity(10.0)
        .initial(10.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let reads = Dependency::new("reads", hedging()).with_budget(budget.clone());
    fill(&reads, &clock).await;
    assert_eq!(budget.balance(), 10.0);
    // Every copy is held: each read is given up by its caller with both copies out.
    let server = support::RawServer::start(vec![support::Action::Delay(
        Duration::from_secs(3600),
        support::ok("never"),
    )])
    .await;
    let client = client(reads.clone(), &clock, Duration::from_millis(50));
    let mut copies = Vec::new();
    for round in 0..12 {
        let before = server.requests();
        let url = server.url("/items");
        let sending = client.clone();
        let request = tokio::spawn(async move { sending.get(url).send().await });
        // Two copies while a token pays for the hedge, then one; a read whose hedge was not
        // paid for is given up once its one copy has arrived.
        let want = if round < 10 { 2 } else { 1 };
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        while server.requests() < before + want {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: no copy"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Time for a hedge that should not go to go.
        tokio::time::sleep(Duration::from_millis(20)).await;
        request.abort();
        assert!(request.await.unwrap_err().is_cancelled());
        copies.push(server.requests() - before);
    }
    assert_eq!(copies, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1]);
    assert_eq!(budget.balance(), 0.0, "every hedge sent stayed paid for");
    assert_eq!(reads.counters().hedges, 10);
}

#[tokio::test]
async fn a_request_dropped_with_two_copies_out_keeps_its_hedge_paid_for() {
    let clock = FakeClock::new();
    let budget = RetryBudget::builder().floor_per_sec(0.0).build().unwrap();
    let reads = Dependency::new("reads", hedging()).with_budget(budget.clone());
    fill(&reads, &clock).await;
    let full = budget.balance();
    // Both copies are held: the first by the server, the second by a server that never
    // answers at all.
    let server = support::RawServer::start(vec![support::Action::Delay(
        Duration::from_secs(3600),
        support::ok("never"),
    )])
    .await;
    let client = client(reads.clone(), &clock, Duration::from_millis(50));
    let url = server.url("/items");
    let request = tokio::spawn(async move { client.get(url).send().await });
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while server.requests() < 2 {
        assert!(std::time::Instant::now() < deadline, "no hedge went");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(budget.balance(), full - 1.0, "the hedge paid one token");

    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());

    assert_eq!(
        budget.balance(),
        full - 1.0,
        "the hedge was sent: it stays paid for"
    );
    assert_eq!(reads.counters().hedges, 1);
    assert_eq!(reads.counters().hedges_won, 0);
}

#[tokio::test]
async fn nested_instances_hedge_once() {
    let clock = FakeClock::new();
    let outer = Dependency::new("outer", hedging());
    let inner = Dependency::new("inner", hedging());
    fill(&outer, &clock).await;
    fill(&inner, &clock).await;
    let server = HoldsTheFirst::start().await;
    let moved = clock.clone();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(outer.clone()).with_clock(clock.clone()))
        .with(RetryMiddleware::new(inner.clone()).with_clock(clock.clone()))
        .with(Before(move |extensions: &mut http::Extensions| {
            if extensions.get::<Seen>().is_none() {
                extensions.insert(Seen);
                moved.advance(Duration::from_millis(50));
            }
            None
        }))
        .build();
    let inner_before = inner.counters();

    let response = hedged_in_time(client.get(&server.url)).await;

    assert!(RetryRecord::of(&response).unwrap().answered_by_hedge());
    assert_eq!(
        server.arrived(),
        2,
        "one first copy and one hedge, not four"
    );
    assert_eq!(outer.counters().hedges, 1);
    assert_eq!(
        inner.counters(),
        inner_before,
        "the inner instance passed both through"
    );
}

#[tokio::test]
async fn a_copy_that_fails_while_the_other_is_out_waits_for_the_other() {
    let clock = FakeClock::new();
    let reads = Dependency::new("reads", hedging());
    fill(&reads, &clock).await;
    // The first copy answers after 40 ms of real time; the hedge at once, with a 503.
    let server = support::RawServer::start(vec![
        support::Action::Delay(Duration::from_millis(40), support::ok("slow")),
        support::Action::Respond(support::unavailable()),
    ])
    .await;
    let client = client(reads.clone(), &clock, Duration::from_millis(50));

    let response = client.get(server.url("/items")).send().await.unwrap();

    let record = RetryRecord::of(&response).unwrap();
    assert!(!record.answered_by_hedge());
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::Succeeded)
    );
    assert_eq!(response.text().await.unwrap(), "slow");
    assert_eq!(
        server.requests(),
        2,
        "no retry while the first copy was out"
    );
    assert!(clock.sleeps().is_empty());
    assert_eq!(
        (reads.counters().hedges, reads.counters().hedges_won),
        (1, 0)
    );
}

/// Behind the tower door, a hedge is decided and paid only when the service beneath is ready
/// for its copy: under a service that takes one request at a time, whose one slot the first
/// copy holds, the hedging delay passes with nothing counted and no token spent, and the first
/// copy's answer ends the request. (Through the reqwest door every copy is handed to the chain
/// at once, and is paid then: `a_slow_first_copy_is_hedged_after_the_p95_and_the_fast_answer_wins`.)
#[cfg(feature = "tower")]
#[tokio::test]
async fn a_hedge_that_waits_for_the_service_beneath_to_be_ready_is_not_paid_for() {
    use tower_layer::Layer;
    use tower_service::Service;

    let clock = FakeClock::new();
    let budget = RetryBudget::builder()
        .capacity(10.0)
        .initial(10.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let reads = Dependency::new("reads", hedging()).with_budget(budget.clone());
    fill(&reads, &clock).await;
    let gate = OneAtATime::default();
    let mut service = RetryMiddleware::new(reads.clone())
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(9))
        .layer(gate.clone());
    std::future::poll_fn(|cx| Service::<http::Request<String>>::poll_ready(&mut service, cx))
        .await
        .unwrap();
    let before = reads.counters();
    let request = http::Request::get("http://127.0.0.1:9/items").body(String::new());
    let mut call = tokio::spawn(service.call(request.unwrap()));
    // The first copy is out and holds the one slot; the hedging delay passes.
    for _ in 0..100 {
        if gate.calls.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(gate.calls.load(Ordering::SeqCst), 1);
    clock.advance(Duration::from_millis(500));
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    assert!(
        gate.asked_while_busy.load(Ordering::SeqCst) > 0,
        "the hedge asked"
    );
    assert_eq!(
        reads.counters().hedges,
        before.hedges,
        "no hedge counted while it waits"
    );
    assert_eq!(budget.balance(), 10.0, "no token spent while it waits");
    assert!(
        tokio::time::timeout(Duration::from_millis(1), &mut call)
            .await
            .is_err()
    );
    // The first copy answers: the request ends with it, and the waiting copy never went.
    gate.release.notify_one();
    let response = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("the first copy's answer ends the request")
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(!RetryRecord::of(&response).unwrap().answered_by_hedge());
    assert_eq!(gate.calls.load(Ordering::SeqCst), 1);
    assert_eq!(reads.counters().hedges, before.hedges);
    assert_eq!(budget.balance(), 10.0);
}

/// A service that takes one request at a time: not ready while a call is out, and each call
/// waits for `release`.
#[cfg(feature = "tower")]
#[derive(Clone, Default)]
struct OneAtATime {
    busy: Arc<Mutex<(bool, Vec<std::task::Waker>)>>,
    release: Arc<tokio::sync::Notify>,
    calls: Arc<AtomicUsize>,
    asked_while_busy: Arc<AtomicUsize>,
}

#[cfg(feature = "tower")]
impl<Q> tower_service::Service<Q> for OneAtATime {
    type Response = http::Response<http_body_util::Full<bytes::Bytes>>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, std::io::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), std::io::Error>> {
        let mut busy = self.busy.lock().unwrap();
        if busy.0 {
            self.asked_while_busy.fetch_add(1, Ordering::SeqCst);
            busy.1.push(cx.waker().clone());
            return std::task::Poll::Pending;
        }
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Q) -> Self::Future {
        self.busy.lock().unwrap().0 = true;
        self.calls.fetch_add(1, Ordering::SeqCst);
        let (busy, release) = (self.busy.clone(), self.release.clone());
        Box::pin(async move {
            release.notified().await;
            let mut slot = busy.lock().unwrap();
            slot.0 = false;
            slot.1.drain(..).for_each(std::task::Waker::wake);
            Ok(http::Response::new(http_body_util::Full::new(
                bytes::Bytes::from_static(b"done"),
            )))
        })
    }
}
