//! The documented span and event fields, captured from a retried request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{Dependency, FakeClock, RetryMiddleware, RetryPolicy};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use wiremock::ResponseTemplate;

/// One span or event: its name (the message, for events), target and fields as text.
#[derive(Debug, Clone)]
struct Captured {
    id: u64,
    level: tracing::Level,
    name: String,
    target: String,
    fields: Vec<(String, String)>,
    /// For an event, the span entered on its thread when it was recorded.
    within: Option<u64>,
    /// The thread it was recorded on: each test reads only its own.
    thread: std::thread::ThreadId,
}

/// What this thread recorded.
fn mine(all: &Mutex<Vec<Captured>>) -> Vec<Captured> {
    let me = std::thread::current().id();
    all.lock()
        .unwrap()
        .iter()
        .filter(|c| c.thread == me)
        .cloned()
        .collect()
}

impl Captured {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name().to_owned(), value.to_owned()));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.push((field.name().to_owned(), value.to_string()));
    }
}

/// A subscriber that keeps everything from this crate's target.
#[derive(Default, Clone)]
struct Capture {
    spans: Arc<Mutex<Vec<Captured>>>,
    events: Arc<Mutex<Vec<Captured>>>,
    next_id: Arc<AtomicU64>,
}

impl Subscriber for Capture {
    // A callsite's interest is cached for the whole process: answering "sometimes" makes every
    // event ask `enabled`, which asks this thread's capture. Other crates' callsites (hyper's,
    // h2's: many, in every test of this binary) are never of interest, and cost nothing then.
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        if meta.target() == "reqwest_safe_retry" {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target() == "reqwest_safe_retry"
            && CAPTURING.with(|c| c.get())
            && *metadata.level() <= LEVEL.with(|l| l.get())
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut fields = Vec::new();
        span.record(&mut Fields(&mut fields));
        let id = self.next_id.fetch_add(1, Ordering::SeqCst) + 1;
        self.spans.lock().unwrap().push(Captured {
            id,
            level: *span.metadata().level(),
            name: span.metadata().name().to_owned(),
            target: span.metadata().target().to_owned(),
            fields,
            within: None,
            thread: std::thread::current().id(),
        });
        Id::from_u64(id)
    }

    /// A value recorded after the span was made is appended to its fields, so a field recorded
    /// twice appears twice, in order.
    fn record(&self, id: &Id, values: &Record<'_>) {
        let mut spans = self.spans.lock().unwrap();
        if let Some(span) = spans.iter_mut().find(|s| s.id == id.into_u64()) {
            values.record(&mut Fields(&mut span.fields));
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut fields = Vec::new();
        event.record(&mut Fields(&mut fields));
        let message = fields
            .iter()
            .find(|(n, _)| n == "message")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        self.events.lock().unwrap().push(Captured {
            id: 0,
            level: *event.metadata().level(),
            name: message,
            target: event.metadata().target().to_owned(),
            fields,
            within: ENTERED.with(|e| e.borrow().last().copied()),
            thread: std::thread::current().id(),
        });
    }

    fn enter(&self, id: &Id) {
        ENTERED.with(|e| e.borrow_mut().push(id.into_u64()));
    }
    fn exit(&self, _: &Id) {
        ENTERED.with(|e| e.borrow_mut().pop());
    }
}

thread_local! {
    /// The spans entered on this thread, innermost last.
    static ENTERED: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
    static CAPTURING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The most verbose level this thread's capture takes, as a subscriber's level filter.
    static LEVEL: std::cell::Cell<tracing::Level> = const { std::cell::Cell::new(tracing::Level::TRACE) };
}

/// The process-wide capture. A thread-local subscriber (`set_default`) is not enough here: tests
/// run on parallel threads, and a callsite first reached on a thread without a subscriber would be
/// cached as uninteresting for every thread. A global subscriber that records only on threads
/// that asked for it has no such race.
fn capture() -> &'static Capture {
    static CAPTURE: std::sync::OnceLock<Capture> = std::sync::OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture = Capture::default();
        tracing::subscriber::set_global_default(capture.clone())
            .expect("the only global subscriber in this test binary");
        capture
    })
}

/// The middleware whose retried GET the span and event tests read: a 503, then a 200.
fn inventory() -> RetryMiddleware {
    RetryMiddleware::new(Dependency::new("inventory", RetryPolicy::default()))
        .with_clock(FakeClock::new())
        .with_rng(|| u64::MAX)
}

#[tokio::test(flavor = "current_thread")]
async fn a_retried_request_emits_the_documented_span_and_events() {
    let capture = capture();
    CAPTURING.with(|c| c.set(true));
    let server =
        crate::support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(inventory())
        .build();

    client
        .get(format!("{}/items?secret=1", server.uri()))
        .send()
        .await
        .unwrap();

    CAPTURING.with(|c| c.set(false));
    the_documented_span_and_events(capture);
}

/// The same request through the tower door: the same span, fields and events.
#[cfg(feature = "tower")]
#[tokio::test(flavor = "current_thread")]
async fn through_the_tower_door_a_retried_request_emits_the_same_span_and_events() {
    let capture = capture();
    CAPTURING.with(|c| c.set(true));
    let server =
        crate::support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;

    let ended = crate::doors::Door::Tower
        .get(inventory(), &format!("{}/items?secret=1", server.uri()))
        .await;

    CAPTURING.with(|c| c.set(false));
    assert_eq!(ended.status, Some(200));
    the_documented_span_and_events(capture);
}

/// What this thread captured from a GET of `/items?secret=1` by [`inventory`], answered 503
/// then 200.
fn the_documented_span_and_events(capture: &Capture) {
    let spans = mine(&capture.spans);
    assert_eq!(spans.len(), 1);
    let span = &spans[0];
    assert_eq!(span.name, "reqwest_safe_retry.request");
    assert_eq!(span.target, "reqwest_safe_retry");
    assert_eq!(span.field("dependency"), Some("inventory"));
    assert_eq!(span.field("method"), Some("GET"));
    assert_eq!(span.field("host"), Some("127.0.0.1"));
    // The path, never the query: query strings often carry secrets.
    assert_eq!(span.field("path"), Some("/items"));
    // Recorded at the retry, as OpenTelemetry's HTTP client conventions name it.
    assert_eq!(span.field("http.request.resend_count"), Some("1"));

    let events = mine(&capture.events);
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        ["attempt finished", "attempt finished", "retrying stopped"]
    );
    let first = &events[0];
    assert_eq!(first.field("attempt"), Some("1"));
    assert_eq!(first.field("status"), Some("503"));
    assert_eq!(first.field("decision"), Some("status"));
    assert_eq!(first.field("delay_ms"), Some("100"));
    let second = &events[1];
    assert_eq!(second.field("attempt"), Some("2"));
    assert_eq!(second.field("status"), Some("200"));
    assert_eq!(second.field("decision"), Some("succeeded"));
    assert_eq!(second.field("delay_ms"), None);
    let stop = &events[2];
    assert_eq!(stop.field("attempts"), Some("2"));
    assert_eq!(stop.field("reason"), Some("succeeded"));
    assert_eq!(stop.field("waited_ms"), Some("100"));
    assert!(events.iter().all(|e| e.target == "reqwest_safe_retry"));
    // Every event is within the request's span.
    assert!(
        events.iter().all(|e| e.within == Some(span.id)),
        "{events:?}"
    );
}

/// The `error` field's documented values, in the events and in the observer alike: a refused
/// port is `connect` (and retried), another middleware's error is `permanent` (and final).
#[tokio::test(flavor = "current_thread")]
async fn failed_attempts_name_their_error_kind_in_events_and_the_observer() {
    let capture = capture();
    CAPTURING.with(|c| c.set(true));
    /// Per call: the attempt, its error kind, its stop reason.
    type Seen = Vec<(u32, Option<String>, Option<String>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let observer = {
        let seen = seen.clone();
        move |event: &reqwest_safe_retry::RetryEvent<'_>| {
            seen.lock().unwrap().push((
                event.attempt,
                event.error.map(|e| e.as_str().to_owned()),
                event.stop.map(|s| s.as_str().to_owned()),
            ));
        }
    };
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(RetryPolicy::builder().max_attempts(2).build().unwrap())
                .with_clock(FakeClock::new())
                .with_observer(observer),
        )
        .build();

    let refused = crate::support::refused_url().await;
    client.get(refused).send().await.unwrap_err();

    CAPTURING.with(|c| c.set(false));
    let events = mine(&capture.events);
    let attempts: Vec<_> = events
        .iter()
        .filter(|e| e.name == "attempt finished")
        .map(|e| {
            (
                e.field("error").map(str::to_owned),
                e.field("decision").map(str::to_owned),
            )
        })
        .collect();
    assert_eq!(
        attempts,
        [
            (Some("connect".to_owned()), Some("connect".to_owned())),
            (
                Some("connect".to_owned()),
                Some("attempts_exhausted".to_owned())
            ),
        ]
    );
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (1, Some("connect".to_owned()), None),
            (
                2,
                Some("connect".to_owned()),
                Some("attempts_exhausted".to_owned())
            ),
        ]
    );
}

/// A give-up at WARN says what went wrong itself: the last attempt's error kind, or its
/// status; a request stopped before sending anything names no error, its reason says why.
#[tokio::test(flavor = "current_thread")]
async fn a_give_up_names_the_last_attempt_s_error_or_status() {
    let capture = capture();
    let dry = || {
        let budget = reqwest_safe_retry::RetryBudget::builder()
            .initial(0.0)
            .floor_per_sec(0.0)
            .build()
            .unwrap();
        Dependency::new("inventory", RetryPolicy::default()).with_budget(budget)
    };
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(dry()).with_clock(FakeClock::new()))
        .build();
    let server = crate::support::always(503).await;
    let refused = crate::support::refused_url().await;
    let before = mine(&capture.events).len();
    LEVEL.with(|l| l.set(tracing::Level::WARN));
    CAPTURING.with(|c| c.set(true));
    client.get(refused).send().await.unwrap_err();
    client.get(server.uri()).send().await.unwrap();
    client
        .get(server.uri())
        .with_extension(reqwest_safe_retry::RetryOverride::new().max_attempts(0))
        .send()
        .await
        .unwrap_err();
    CAPTURING.with(|c| c.set(false));
    LEVEL.with(|l| l.set(tracing::Level::TRACE));

    let stops: Vec<_> = mine(&capture.events)[before..]
        .iter()
        .map(|e| {
            let field = |name| e.field(name).map(str::to_owned);
            (e.level, field("reason"), field("error"), field("status"))
        })
        .collect();
    let owned = |s: &str| Some(s.to_owned());
    assert_eq!(
        stops,
        [
            (
                tracing::Level::WARN,
                owned("budget_exhausted"),
                owned("connect"),
                None
            ),
            (
                tracing::Level::WARN,
                owned("budget_exhausted"),
                None,
                owned("503")
            ),
            (tracing::Level::WARN, owned("invalid_override"), None, None),
        ]
    );
}

/// Turns every answer into reqwest's status error, as a middleware calling `error_for_status`
/// further in would.
struct StatusAsError;

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for StatusAsError {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let response = next.run(request, extensions).await?;
        Ok(response.error_for_status()?)
    }
}

/// An error that carries a status (reqwest's, made by a middleware further in) names it in the
/// attempt's event and the stop's, beside its error kind, as an answer's status is named.
#[tokio::test(flavor = "current_thread")]
async fn an_error_that_carries_a_status_names_it_in_the_events() {
    let capture = capture();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(inventory())
        .with(StatusAsError)
        .build();
    let server = crate::support::always(503).await;
    let before = mine(&capture.events).len();
    CAPTURING.with(|c| c.set(true));
    client.get(server.uri()).send().await.unwrap_err();
    CAPTURING.with(|c| c.set(false));

    let named: Vec<_> = mine(&capture.events)[before..]
        .iter()
        .map(|e| {
            let field = |name| e.field(name).map(str::to_owned);
            (e.name.clone(), field("status"), field("error"))
        })
        .collect();
    let owned = |s: &str| Some(s.to_owned());
    assert_eq!(
        named,
        [
            (
                "attempt finished".to_owned(),
                owned("503"),
                owned("permanent")
            ),
            (
                "retrying stopped".to_owned(),
                owned("503"),
                owned("permanent")
            ),
        ]
    );
}

/// An inner middleware reads each attempt's number from its extensions, and the span records
/// every retry's resend count.
#[tokio::test(flavor = "current_thread")]
async fn inner_middleware_sees_each_attempt_s_number() {
    let capture = capture();
    CAPTURING.with(|c| c.set(true));
    let server = crate::support::always(503).await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new(
                    "default",
                    RetryPolicy::builder().max_attempts(4).build().unwrap(),
                )
                .without_budget(),
            )
            .with_clock(FakeClock::new()),
        )
        .with(crate::support::Before({
            let seen = seen.clone();
            move |extensions: &mut http::Extensions| {
                let attempt = reqwest_safe_retry::RetryAttempt::of(extensions);
                seen.lock()
                    .unwrap()
                    .push((attempt.number(), attempt.resend_count()));
                None
            }
        }))
        .build();

    client.get(server.uri()).send().await.unwrap();
    client.get(server.uri()).send().await.unwrap();

    CAPTURING.with(|c| c.set(false));
    let per_request = [(1, 0), (2, 1), (3, 2), (4, 3)];
    assert_eq!(*seen.lock().unwrap(), [per_request, per_request].concat());
    let spans = mine(&capture.spans);
    assert_eq!(spans.len(), 2);
    for span in spans {
        let recorded: Vec<&str> = span
            .fields
            .iter()
            .filter(|(n, _)| n == "http.request.resend_count")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(recorded, ["1", "2", "3"]);
    }
}

/// The levels of one request's events, in order, and the stop event's status.
async fn levels_of(
    middleware: RetryMiddleware,
    server: &wiremock::MockServer,
) -> (Vec<tracing::Level>, Option<String>) {
    let capture = capture();
    let before = mine(&capture.events).len();
    CAPTURING.with(|c| c.set(true));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware.with_clock(FakeClock::new()))
        .build();
    client.get(server.uri()).send().await.unwrap();
    CAPTURING.with(|c| c.set(false));
    let events = mine(&capture.events)[before..].to_vec();
    let status = events
        .last()
        .and_then(|e| e.field("status"))
        .map(str::to_owned);
    (events.iter().map(|e| e.level).collect(), status)
}

/// A retry is visible at INFO and a give-up at WARN by default; a request that went as its
/// first attempt went stays at DEBUG; both levels can be set.
#[tokio::test(flavor = "current_thread")]
async fn retries_and_give_ups_are_logged_at_their_levels() {
    use tracing::Level;
    let two = || {
        let policy = RetryPolicy::builder().max_attempts(2).build().unwrap();
        RetryMiddleware::new(Dependency::from(policy).without_budget())
    };

    let recovers =
        crate::support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    assert_eq!(
        levels_of(two(), &recovers).await,
        (
            vec![Level::INFO, Level::DEBUG, Level::INFO],
            Some("200".to_owned())
        )
    );

    let down = crate::support::always(503).await;
    assert_eq!(
        levels_of(two(), &down).await,
        (
            vec![Level::INFO, Level::DEBUG, Level::WARN],
            Some("503".to_owned())
        )
    );

    let fine = crate::support::always(200).await;
    assert_eq!(
        levels_of(two(), &fine).await.0,
        [Level::DEBUG, Level::DEBUG]
    );

    // A final answer at once is no give-up; after a retry, it ends at the retry's level.
    let missing = crate::support::always(404).await;
    assert_eq!(
        levels_of(two(), &missing).await,
        (vec![Level::DEBUG, Level::DEBUG], Some("404".to_owned()))
    );
    let gone =
        crate::support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(404)).await;
    assert_eq!(
        levels_of(two(), &gone).await,
        (
            vec![Level::INFO, Level::DEBUG, Level::INFO],
            Some("404".to_owned())
        )
    );

    let quiet = two()
        .with_retry_log_level(Level::DEBUG)
        .with_give_up_log_level(Level::ERROR);
    assert_eq!(
        levels_of(quiet, &down).await.0,
        [Level::DEBUG, Level::DEBUG, Level::ERROR]
    );

    // A success after a retry is never logged above INFO, whatever the retry's level.
    let loud = || two().with_retry_log_level(Level::WARN);
    let recovers =
        crate::support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    assert_eq!(
        levels_of(loud(), &recovers).await.0,
        [Level::WARN, Level::DEBUG, Level::INFO]
    );
    assert_eq!(
        levels_of(loud(), &down).await.0,
        [Level::WARN, Level::DEBUG, Level::WARN]
    );
}

/// With a subscriber at INFO, the retry's and the give-up's events say what was retried
/// themselves (the span, at DEBUG, is not there): the dependency, the method, the host with its
/// port, and the path, never the query.
#[tokio::test(flavor = "current_thread")]
async fn at_info_the_retry_and_give_up_events_name_the_dependency_method_host_and_path() {
    let capture = capture();
    let server = crate::support::always(503).await;
    let policy = RetryPolicy::builder().max_attempts(2).build().unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(Dependency::new("payments", policy).without_budget())
                .with_clock(FakeClock::new()),
        )
        .build();
    let before = mine(&capture.events).len();
    let spans_before = mine(&capture.spans).len();
    LEVEL.with(|l| l.set(tracing::Level::INFO));
    CAPTURING.with(|c| c.set(true));
    let url = format!("{}/orders/7?token=secret-123#frag", server.uri());
    let response = client.post(url).body("{}").send().await.unwrap();
    CAPTURING.with(|c| c.set(false));
    LEVEL.with(|l| l.set(tracing::Level::TRACE));

    assert_eq!(response.status(), 503);
    assert_eq!(mine(&capture.spans).len(), spans_before, "no span at INFO");
    let events = mine(&capture.events)[before..].to_vec();
    let levels: Vec<_> = events.iter().map(|e| (e.level, e.name.as_str())).collect();
    assert_eq!(
        levels,
        [
            (tracing::Level::INFO, "attempt finished"),
            (tracing::Level::WARN, "retrying stopped"),
        ]
    );
    let host = format!("127.0.0.1:{}", server.address().port());
    for event in &events {
        assert_eq!(event.field("dependency"), Some("payments"), "{event:?}");
        assert_eq!(event.field("method"), Some("POST"), "{event:?}");
        assert_eq!(event.field("host"), Some(host.as_str()), "{event:?}");
        assert_eq!(event.field("path"), Some("/orders/7"), "{event:?}");
        for (name, value) in &event.fields {
            assert!(
                !value.contains("secret") && !value.contains("token") && !value.contains("frag"),
                "{name} = {value}"
            );
        }
    }
}

/// Whatever levels the retries and give-ups are logged at, a subscriber that takes exactly
/// those levels gets events that name the request.
#[tokio::test(flavor = "current_thread")]
async fn at_every_level_the_events_a_subscriber_takes_name_the_request() {
    use tracing::Level;
    let capture = capture();
    let server = crate::support::always(503).await;
    for level in [
        Level::ERROR,
        Level::WARN,
        Level::INFO,
        Level::DEBUG,
        Level::TRACE,
    ] {
        let policy = RetryPolicy::builder().max_attempts(2).build().unwrap();
        let client = ClientBuilder::new(reqwest::Client::new())
            .with(
                RetryMiddleware::new(Dependency::new("orders", policy).without_budget())
                    .with_clock(FakeClock::new())
                    .with_retry_log_level(level)
                    .with_give_up_log_level(level),
            )
            .build();
        let before = mine(&capture.events).len();
        LEVEL.with(|l| l.set(level));
        CAPTURING.with(|c| c.set(true));
        client
            .get(format!("{}/o?k=v", server.uri()))
            .send()
            .await
            .unwrap();
        CAPTURING.with(|c| c.set(false));
        LEVEL.with(|l| l.set(Level::TRACE));

        let events = mine(&capture.events)[before..].to_vec();
        let at_level: Vec<_> = events.iter().filter(|e| e.level == level).collect();
        // The retry's event and the give-up's, at least.
        assert!(at_level.len() >= 2, "{level}: {events:?}");
        for event in at_level {
            assert_eq!(
                event.field("dependency"),
                Some("orders"),
                "{level}: {event:?}"
            );
            assert_eq!(event.field("path"), Some("/o"), "{level}: {event:?}");
        }
    }
}

/// A replayed failure and a failure the server marked not worth retrying are give-ups: at WARN,
/// with a reason of their own on both events.
#[tokio::test(flavor = "current_thread")]
async fn a_replayed_or_declined_failure_is_a_give_up_with_its_own_reason() {
    let capture = capture();
    let cases = [
        ("idempotent-replayed", "true", "replayed_failure"),
        ("x-should-retry", "false", "server_declined_retry"),
    ];
    for (name, value, reason) in cases {
        let server = crate::support::first_then(
            ResponseTemplate::new(503).insert_header(name, value),
            0,
            ResponseTemplate::new(503).insert_header(name, value),
        )
        .await;
        let before = mine(&capture.events).len();
        CAPTURING.with(|c| c.set(true));
        LEVEL.with(|l| l.set(tracing::Level::DEBUG));
        let client = ClientBuilder::new(reqwest::Client::new())
            .with(
                RetryMiddleware::new(Dependency::new("payments", RetryPolicy::default()))
                    .with_clock(FakeClock::new()),
            )
            .build();
        // A caller's own key, which an earlier run may have sent: a replay under it is one.
        let post = client
            .post(server.uri())
            .header("idempotency-key", "order-7");
        post.body("x").send().await.unwrap();
        CAPTURING.with(|c| c.set(false));
        LEVEL.with(|l| l.set(tracing::Level::TRACE));

        let events = mine(&capture.events)[before..].to_vec();
        let seen: Vec<_> = events
            .iter()
            .map(|e| {
                (
                    e.level,
                    e.name.as_str(),
                    e.field("decision"),
                    e.field("reason"),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (
                    tracing::Level::DEBUG,
                    "attempt finished",
                    Some(reason),
                    None
                ),
                (tracing::Level::WARN, "retrying stopped", None, Some(reason)),
            ],
            "{name}: {value}"
        );
        assert_eq!(events[1].field("dependency"), Some("payments"));
        assert_eq!(events[1].field("attempts"), Some("1"));
    }
}

/// Emits an event of the crate's target from inside the chain, beneath the retry middleware.
struct Beneath;

impl reqwest_middleware::Middleware for Beneath {
    fn handle<'a, 'b, 'c, 'd>(
        &'a self,
        request: reqwest::Request,
        extensions: &'b mut http::Extensions,
        next: reqwest_middleware::Next<'c>,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = reqwest_middleware::Result<reqwest::Response>>
                + Send
                + 'd,
        >,
    >
    where
        'a: 'd,
        'b: 'd,
        'c: 'd,
        Self: 'd,
    {
        Box::pin(async move {
            tracing::info!(target: "reqwest_safe_retry", "beneath, before sending");
            let response = next.run(request, extensions).await;
            tracing::info!(target: "reqwest_safe_retry", "beneath, answered");
            response
        })
    }
}

#[tokio::test(flavor = "current_thread")]
async fn what_the_chain_beneath_logs_is_within_the_request_s_span() {
    let capture = capture();
    CAPTURING.with(|c| c.set(true));
    let server =
        crate::support::first_then(ResponseTemplate::new(200), 0, ResponseTemplate::new(200)).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(RetryPolicy::default()).with_clock(FakeClock::new()))
        .with(Beneath)
        .build();
    client.get(server.uri()).send().await.unwrap();
    CAPTURING.with(|c| c.set(false));
    two_events_beneath_within_the_one_span(capture);
}

/// Through the tower door, what the services beneath log when called with a copy is within
/// the request's span too, on every attempt.
#[cfg(feature = "tower")]
#[tokio::test(flavor = "current_thread")]
async fn what_the_services_beneath_the_tower_door_log_is_within_the_request_s_span() {
    let capture = capture();
    CAPTURING.with(|c| c.set(true));
    let server =
        crate::support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    let call = crate::doors::Call::new(http::Method::GET, &server.uri()).beneath(|_| {
        tracing::info!(target: "reqwest_safe_retry", "beneath, called");
    });
    let ended = crate::doors::Door::Tower
        .send(vec![inventory()], call)
        .await;
    CAPTURING.with(|c| c.set(false));
    assert_eq!((ended.status, ended.attempts), (Some(200), 2));
    two_events_beneath_within_the_one_span(capture);
}

/// What this thread captured: one span, and two events from beneath the middleware, both within
/// that span.
fn two_events_beneath_within_the_one_span(capture: &Capture) {
    let spans = mine(&capture.spans);
    assert_eq!(spans.len(), 1);
    let beneath: Vec<_> = mine(&capture.events)
        .into_iter()
        .filter(|e| e.name.starts_with("beneath"))
        .collect();
    assert_eq!(beneath.len(), 2, "{beneath:?}");
    for event in &beneath {
        assert_eq!(event.within, Some(spans[0].id), "{event:?}");
    }
}

/// A classifier that reads the body under a policy that reads none is told, once per
/// classifier, at WARN, with the setting that turns it on; under `buffer_body` it is not.
#[tokio::test(flavor = "current_thread")]
async fn a_classifier_asking_for_a_body_the_policy_does_not_read_is_told_once() {
    let capture = capture();
    CAPTURING.with(|c| c.set(true));
    let server = crate::support::always(503).await;
    let reading = |policy: RetryPolicy| {
        let dependency =
            Dependency::new("bodies", policy).with_classifier(|attempt| match attempt.body() {
                Some(body) if body.starts_with(b"maintenance") => {
                    reqwest_safe_retry::classify::Retryable::Fatal
                }
                _ => attempt.default_verdict(),
            });
        ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(dependency).with_clock(FakeClock::new()))
            .build()
    };
    let told = |capture: &Capture| {
        mine(&capture.events)
            .iter()
            .filter(|e| e.level == tracing::Level::WARN && e.name.contains("buffer_body(limit)"))
            .count()
    };
    let unread = reading(RetryPolicy::default());
    unread.get(server.uri()).send().await.unwrap();
    unread.get(server.uri()).send().await.unwrap();
    assert_eq!(told(capture), 1, "once for six attempts");
    let read = reading(RetryPolicy::builder().buffer_body(1024).build().unwrap());
    read.get(server.uri()).send().await.unwrap();
    CAPTURING.with(|c| c.set(false));
    assert_eq!(told(capture), 1, "not under buffer_body");
}

/// A gRPC call retried once: the same span and events, named by its method's dependency and
/// its path, its reason the committed call's.
#[cfg(feature = "grpc")]
#[tokio::test(flavor = "current_thread")]
async fn through_the_grpc_door_a_retried_call_emits_the_same_span_and_events() {
    use crate::grpc::server::{Act, Script, channel, say, serve, text};
    use tower_layer::Layer;
    let capture = capture();
    let script = Script::new([Act::Fail(tonic::Code::Unavailable, None)]);
    let uri = serve(&script).await;
    let policy = reqwest_safe_retry::grpc::GrpcRetryPolicy::builder()
        .max_attempts(2)
        .initial_backoff(std::time::Duration::from_millis(100))
        .max_backoff(std::time::Duration::from_millis(100))
        .retryable_codes([tonic::Code::Unavailable])
        .build()
        .unwrap();
    let config = reqwest_safe_retry::grpc::GrpcConfig::new()
        .retry("echo.Echo", policy)
        .unwrap();
    let layer = reqwest_safe_retry::grpc::GrpcRetryLayer::new(config)
        .with_clock(FakeClock::new())
        .with_rng(|| u64::MAX);
    CAPTURING.with(|c| c.set(true));
    say(layer.layer(channel(&uri)), text("x")).await.unwrap();
    CAPTURING.with(|c| c.set(false));

    let spans = mine(&capture.spans);
    assert_eq!(spans.len(), 1, "{spans:?}");
    let span = &spans[0];
    assert_eq!(span.name, "reqwest_safe_retry.request");
    assert_eq!(span.field("dependency"), Some("grpc echo.Echo"));
    assert_eq!(span.field("method"), Some("POST"));
    assert_eq!(span.field("path"), Some("/echo.Echo/Say"));
    assert_eq!(span.field("http.request.resend_count"), Some("1"));
    let events = mine(&capture.events);
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        ["attempt finished", "attempt finished", "retrying stopped"]
    );
    assert_eq!(events[0].field("decision"), Some("status"));
    // A6's backoff at the top draw: 100 ms x 1.2.
    assert_eq!(events[0].field("delay_ms"), Some("120"));
    assert_eq!(events[2].field("attempts"), Some("2"));
    assert_eq!(events[2].field("reason"), Some("committed"));
    assert!(
        events.iter().all(|e| e.within == Some(span.id)),
        "{events:?}"
    );
}
