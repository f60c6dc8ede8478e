//! What the benches and the allocation test share: a hyper server on loopback, the seven clients
//! under comparison, and the loop that drives them.
//!
//! Every client sends the same small POST to the same server, in the same process, so what
//! differs between two clients' figures is the client alone.
//!
//! | client | what it is |
//! |---|---|
//! | (a) | a bare `reqwest::Client` |
//! | (b) | `reqwest-middleware` with no middleware: the pass-through chain, the baseline |
//! | (c) | reqwest-retry's `RetryTransientMiddleware`, 3 attempts (the plainest peer) |
//! | (d) | this crate's `RetryMiddleware` with its defaults: keys on POST, a retry budget |
//! | (e) | this crate without idempotency keys |
//! | (g) | (d) with an adaptive throttle, to price it |
//! | (f) | a reference, not a peer: (e) with a fixed 36-character `Idempotency-Key` header put on
//! every attempt, so that (f) - (e) is what one more header of that size costs reqwest and the
//! server, and (d) - (f) is what making and recording a key costs this crate |

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::Extensions;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use reqwest::header::{HeaderName, HeaderValue};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use reqwest_safe_retry::{Dependency, RetryBudget, RetryMiddleware, RetryPolicy};
use tokio::net::TcpListener;

mod grpc;
pub use grpc::{grpc_clients, start_grpc, start_grpc_on_own_thread};

/// The body every client sends: 26 bytes of JSON.
pub const BODY: &str = "{\"order\":42,\"amount\":1000}";

/// How the server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `200 OK` with the body `ok`, to everything.
    Ok,
    /// `503` and `200` in turn, server-wide: with one request at a time, every logical request
    /// meets one 503 and then a 200.
    FailThenOk,
}

/// Starts a keep-alive HTTP/1.1 hyper server on 127.0.0.1 on the current runtime, which reads
/// every request's body in full before it answers; returns its address.
pub async fn start(mode: Mode) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            stream.set_nodelay(true).unwrap();
            let served = served.clone();
            let service = service_fn(move |request: hyper::Request<Incoming>| {
                let served = served.clone();
                async move {
                    let body = request.into_body().collect().await;
                    let read = body.map_or(0, |b| b.to_bytes().len());
                    let n = served.fetch_add(1, Ordering::Relaxed);
                    let (status, answer) = match mode {
                        Mode::FailThenOk if n.is_multiple_of(2) => (503, Bytes::new()),
                        _ if read == BODY.len() => (200, Bytes::from_static(b"ok")),
                        _ => (400, Bytes::new()),
                    };
                    let response = hyper::Response::builder()
                        .status(status)
                        .body(Full::new(answer))
                        .unwrap();
                    Ok::<_, Infallible>(response)
                }
            });
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// Starts the same server on a thread and runtime of its own, which run until the process
/// ends: for measurements of the client's side alone.
pub fn start_on_own_thread(mode: Mode) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            tx.send(start(mode).await).unwrap();
            std::future::pending::<()>().await;
        });
    });
    rx.recv().unwrap()
}

/// One of the clients under comparison.
#[derive(Clone)]
pub enum Client {
    /// (a): no middleware chain at all.
    Bare(reqwest::Client),
    /// (b) to (g), (i): a `reqwest-middleware` chain.
    Chain(ClientWithMiddleware),
    /// (h): a `reqwest-middleware` chain whose caller sets a fresh UUID v4 `Idempotency-Key` on
    /// every POST by hand, as a user without this crate's keys would.
    HandKeyed(ClientWithMiddleware),
    /// A `reqwest-middleware` chain sent PUTs instead of POSTs: the retry path of a client that
    /// retries only what is idempotent without a key.
    ChainPut(ClientWithMiddleware),
    /// A tower service of `http::Request`s (see [`tower_clients`]).
    Tower(TowerPost),
}

/// How a tower client sends one POST of [`BODY`] to a URL and reads the answer: the status.
pub type TowerPost = Arc<dyn Fn(&str) -> Pin<Box<dyn Future<Output = u16> + Send>> + Send + Sync>;

impl Client {
    /// Sends one POST (a PUT for [`Client::ChainPut`]) and reads the answer's body; returns
    /// the status.
    pub async fn post(&self, url: &str) -> u16 {
        let response = match self {
            Client::Tower(post) => return post(url).await,
            Client::Bare(c) => c.post(url).body(BODY).send().await.unwrap(),
            Client::Chain(c) => c.post(url).body(BODY).send().await.unwrap(),
            Client::ChainPut(c) => c.put(url).body(BODY).send().await.unwrap(),
            Client::HandKeyed(c) => c
                .post(url)
                .header("idempotency-key", uuid::Uuid::new_v4().to_string())
                .body(BODY)
                .send()
                .await
                .unwrap(),
        };
        let status = response.status().as_u16();
        response.bytes().await.unwrap();
        status
    }
}

/// reqwest-retry's middleware with 3 attempts; `zero_backoff` for the retry path.
pub fn reqwest_retry(
    zero_backoff: bool,
) -> reqwest_retry::RetryTransientMiddleware<reqwest_retry::policies::ExponentialBackoff> {
    let mut policy = reqwest_retry::policies::ExponentialBackoff::builder();
    if zero_backoff {
        policy = policy.retry_bounds(Duration::ZERO, Duration::ZERO);
    }
    reqwest_retry::RetryTransientMiddleware::new_with_policy(policy.build_with_max_retries(2))
}

/// A client's label, and the function that builds it.
pub type Labelled = (&'static str, fn() -> Client);

/// The clients of the success path, each with its label and a function that builds it: a
/// measured process builds only the one it measures, so the others leave no trace in its heap
/// (glibc's allocator costs a different number of instructions on a different heap).
pub fn clients() -> Vec<Labelled> {
    fn chain() -> ClientBuilder {
        ClientBuilder::new(reqwest::Client::new())
    }
    fn ours(dependency: impl FnOnce(Dependency) -> Dependency) -> RetryMiddleware {
        RetryMiddleware::new(dependency(Dependency::new("bench", RetryPolicy::default())))
    }
    vec![
        ("(a) bare reqwest", || Client::Bare(reqwest::Client::new())),
        ("(b) reqwest-middleware", || Client::Chain(chain().build())),
        ("(c) reqwest-retry", || {
            Client::Chain(chain().with(reqwest_retry(false)).build())
        }),
        ("(d) this crate", || {
            Client::Chain(chain().with(ours(|d| d)).build())
        }),
        ("(e) without keys", || {
            Client::Chain(
                chain()
                    .with(ours(Dependency::without_idempotency_keys))
                    .build(),
            )
        }),
        ("(g) (d) + throttle", || {
            let throttle = reqwest_safe_retry::AdaptiveThrottle::default();
            Client::Chain(chain().with(ours(|d| d.with_throttle(throttle))).build())
        }),
        ("(i) (e) + timeout from latency", || {
            let policy = RetryPolicy::builder()
                .timeout_from_latency(2.0, Duration::from_millis(1))
                .build()
                .unwrap();
            let dependency = Dependency::new("bench", policy).without_idempotency_keys();
            Client::Chain(chain().with(RetryMiddleware::new(dependency)).build())
        }),
        ("(f) (e) + a fixed header", || {
            Client::Chain(
                chain()
                    .with(ours(Dependency::without_idempotency_keys))
                    .with(FixedKeyHeader)
                    .build(),
            )
        }),
        ("(h) (b) + a key by hand", || {
            Client::HandKeyed(chain().build())
        }),
        // The same guarantee as (e): reqwest-retry over a client whose every attempt is cut at
        // 10 s, this crate's default attempt timeout.
        ("(c+t) (c) + 10 s timeout", || {
            let timed = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap();
            Client::Chain(ClientBuilder::new(timed).with(reqwest_retry(false)).build())
        }),
        ("(h+t) (h) + 10 s timeout", || {
            let timed = reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap();
            Client::HandKeyed(ClientBuilder::new(timed).with(reqwest_retry(false)).build())
        }),
    ]
}

/// Puts the same `Idempotency-Key` value, as long as a default key, on every request it sees:
/// the reference client (f) measures the header's own cost with it.
#[derive(Debug, Clone, Copy)]
pub struct FixedKeyHeader;

impl Middleware for FixedKeyHeader {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        mut request: reqwest::Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<
        Box<
            dyn Future<Output = reqwest_middleware::Result<reqwest::Response>>
                + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        request.headers_mut().insert(
            HeaderName::from_static("idempotency-key"),
            HeaderValue::from_static("6f1c1f4e-0d7b-4a4e-9a38-2f1d5c7b9e01"),
        );
        next.run(request, extensions)
    }
}

/// The two clients of the retry path (a 503, then a 200, no backoff): (c) and (d), each with
/// its label and a function that builds it.
pub fn retrying_clients() -> Vec<Labelled> {
    fn chain() -> ClientBuilder {
        ClientBuilder::new(reqwest::Client::new())
    }
    /// This crate with no backoff, and a budget that never runs dry here: the bench measures
    /// the retry, not a refusal.
    fn ours(dependency: impl FnOnce(Dependency) -> Dependency) -> RetryMiddleware {
        let zero = RetryPolicy::builder()
            .base_delay(Duration::ZERO)
            .max_delay(Duration::ZERO)
            .build()
            .unwrap();
        let budget = RetryBudget::builder().capacity(1e12).build().unwrap();
        RetryMiddleware::new(dependency(
            Dependency::new("bench", zero).with_budget(budget),
        ))
    }
    vec![
        ("(c) reqwest-retry", || {
            Client::Chain(chain().with(reqwest_retry(true)).build())
        }),
        ("(d) this crate", || {
            Client::Chain(chain().with(ours(|d| d)).build())
        }),
        // Without a key only an idempotent method is retried: PUT, for both.
        ("(c) reqwest-retry, PUT", || {
            Client::ChainPut(chain().with(reqwest_retry(true)).build())
        }),
        ("(e) without keys, PUT", || {
            Client::ChainPut(
                chain()
                    .with(ours(Dependency::without_idempotency_keys))
                    .build(),
            )
        }),
        // The tower door's retry path: tower's retry over `tower::timeout` (a budget that
        // never runs dry here; it retries a POST without a key, which this crate will not)
        // against this crate's layer with keys.
        ("(T5) tower retry + 10 s timeout", || {
            let budget = Arc::new(tower::retry::budget::TpsBudget::new(
                Duration::from_secs(10),
                1_000_000,
                0.2,
            ));
            let policy = TowerAttempts { left: 2, budget };
            let timed = tower::timeout::Timeout::new(full_client(), Duration::from_secs(10));
            tower_post(tower::retry::Retry::new(policy, timed), full)
        }),
        ("(T4) this crate, keys", || {
            let layer = tower::Layer::layer(&ours(|d| d), hyper_client());
            tower_post(layer, full)
        }),
    ]
}

/// The middlewares whose own instructions the instruction bench counts, each between [`Enter`]
/// and [`Leave`] in a chain of its own: (c), (d) and (e), with their labels.
pub fn own_clients() -> Vec<Labelled> {
    fn between(middleware: impl Middleware) -> Client {
        Client::Chain(
            ClientBuilder::new(reqwest::Client::new())
                .with(Enter {})
                .with(middleware)
                .with(Leave {})
                .build(),
        )
    }
    fn ours(dependency: impl FnOnce(Dependency) -> Dependency) -> RetryMiddleware {
        RetryMiddleware::new(dependency(Dependency::new("bench", RetryPolicy::default())))
    }
    vec![
        ("(c) reqwest-retry", || between(reqwest_retry(false))),
        ("(d) this crate", || between(ours(|d| d))),
        ("(e) without keys", || {
            between(ours(Dependency::without_idempotency_keys))
        }),
    ]
}

/// A future of the rest of a chain.
type Rest<'a> =
    Pin<Box<dyn Future<Output = reqwest_middleware::Result<reqwest::Response>> + Send + 'a>>;

/// A marker in the chain: [`Enter`] where the measured middleware begins, [`Leave`] where it ends.
#[derive(Debug, Clone, Copy)]
pub struct Marker<const BENEATH: bool>;

/// Marks where the measured middleware begins: everything the middleware after it does, in
/// its `handle`, in its future's polls and in its future's drop, runs inside the `measured_*`
/// functions, which callgrind's `--toggle-collect` turns counting on for.
pub type Enter = Marker<false>;

/// Marks where the measured middleware ends: the chain beneath it runs inside the `beneath_*`
/// functions, which turn counting off again (and on when they return).
pub type Leave = Marker<true>;

/// The future of a chain run inside markers of one kind (`BENEATH`: [`Leave`]'s, else
/// [`Enter`]'s).
struct Marked<'a, const BENEATH: bool>(Option<Rest<'a>>);

impl<const BENEATH: bool> Middleware for Marker<BENEATH> {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: reqwest::Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Rest<'async_trait>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        if BENEATH {
            // Boxed inside the marker, where nothing is counted.
            return beneath_handle(next, request, extensions);
        }
        // Boxed out here, after the measured middleware's `handle` has returned.
        let rest = measured_handle(next, request, extensions);
        Box::pin(Marked::<false>(Some(rest)))
    }
}

impl<const BENEATH: bool> Future for Marked<'_, BENEATH> {
    type Output = reqwest_middleware::Result<reqwest::Response>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let Some(rest) = self.0.as_mut() else {
            panic!("polled after it was dropped");
        };
        if BENEATH {
            beneath_poll(rest, cx)
        } else {
            measured_poll(rest, cx)
        }
    }
}

impl<const BENEATH: bool> Drop for Marked<'_, BENEATH> {
    fn drop(&mut self) {
        if BENEATH {
            beneath_drop(self.0.take());
        } else {
            measured_drop(self.0.take());
        }
    }
}

/// Three marker functions, `$handle`, `$poll` and `$drop`: never inlined, and each with a body
/// of its own (the `$mark`s differ, so that no two are merged into one symbol), as small as a
/// call can be. `$wrap` is what `$handle` does with the rest of the chain's future.
macro_rules! markers {
    ($handle:ident, $poll:ident, $drop:ident, $mark:literal, $wrap:expr) => {
        #[inline(never)]
        fn $handle<'a>(
            next: Next<'a>,
            request: reqwest::Request,
            ext: &'a mut Extensions,
        ) -> Rest<'a> {
            std::hint::black_box($mark);
            $wrap(next.run(request, ext))
        }

        #[inline(never)]
        fn $poll(
            rest: &mut Rest<'_>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<reqwest_middleware::Result<reqwest::Response>> {
            std::hint::black_box($mark + 1);
            rest.as_mut().poll(cx)
        }

        #[inline(never)]
        fn $drop(rest: Option<Rest<'_>>) {
            std::hint::black_box($mark + 2);
            drop(rest);
        }
    };
}

markers!(measured_handle, measured_poll, measured_drop, 1u8, |rest| {
    rest
});
// The chain beneath is boxed with its markers inside `beneath_handle`, where nothing is counted.
markers!(
    beneath_handle,
    beneath_poll,
    beneath_drop,
    4u8,
    |rest| -> Rest<'_> { Box::pin(Marked::<true>(Some(rest))) }
);

/// Sends `total` POSTs through `client`, `in_flight` at a time on the current runtime.
pub async fn run(client: &Client, url: &str, total: u64, in_flight: u64) {
    if in_flight <= 1 {
        for _ in 0..total {
            client.post(url).await;
        }
        return;
    }
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..in_flight {
        let (client, url) = (client.clone(), url.to_owned());
        let share = total / in_flight + u64::from(worker < total % in_flight);
        tasks.spawn(async move {
            for _ in 0..share {
                client.post(&url).await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
}

/// The tower clients, each over hyper-util's client on the same server, each sent the same
/// `Full<Bytes>` body: the bare service, tower's own retry with a TPS budget, and this crate's
/// layer with and without keys (whose inner client takes the layer's `SendBody`).
pub fn tower_clients() -> Vec<Labelled> {
    vec![
        ("(T0) hyper-util, Full", || tower_post(full_client(), full)),
        ("(T2) tower retry + TpsBudget", || {
            let budget = Arc::new(tower::retry::budget::TpsBudget::new(
                Duration::from_secs(10),
                10,
                0.2,
            ));
            let policy = TowerAttempts { left: 2, budget };
            tower_post(tower::retry::Retry::new(policy, full_client()), full)
        }),
        // The same guarantee as (T3): tower's retry over `tower::timeout` at 10 s, this crate's
        // default attempt timeout.
        ("(T5) (T2) + 10 s timeout", || {
            let budget = Arc::new(tower::retry::budget::TpsBudget::new(
                Duration::from_secs(10),
                10,
                0.2,
            ));
            let policy = TowerAttempts { left: 2, budget };
            let timed = tower::timeout::Timeout::new(full_client(), Duration::from_secs(10));
            tower_post(tower::retry::Retry::new(policy, timed), full)
        }),
        ("(T3) this crate, no keys", || {
            let dependency =
                Dependency::new("bench", RetryPolicy::default()).without_idempotency_keys();
            let layer = tower::Layer::layer(&RetryMiddleware::new(dependency), hyper_client());
            tower_post(layer, full)
        }),
        ("(T4) this crate, keys", || {
            let dependency = Dependency::new("bench", RetryPolicy::default());
            let layer = tower::Layer::layer(&RetryMiddleware::new(dependency), hyper_client());
            tower_post(layer, full)
        }),
    ]
}

type HyperClient<B> =
    hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, B>;

fn full_client() -> HyperClient<Full<Bytes>> {
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// hyper-util's client for a request body of any type (this crate's layer: its `SendBody`).
fn hyper_client<B>() -> HyperClient<B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
{
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

fn full() -> Full<Bytes> {
    Full::new(Bytes::from_static(BODY.as_bytes()))
}

/// A tower client that POSTs `body()` through `service`.
fn tower_post<S, B, R>(service: S, body: fn() -> B) -> Client
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    B: Send + 'static,
    R: http_body::Body + Send + 'static,
    R::Data: Send,
    R::Error: std::fmt::Debug,
{
    Client::Tower(Arc::new(move |url: &str| {
        let mut service = service.clone();
        let request = http::Request::post(url).body(body()).unwrap();
        Box::pin(async move {
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .unwrap();
            let response = service.call(request).await.unwrap();
            let status = response.status().as_u16();
            response.into_body().collect().await.unwrap();
            status
        })
    }))
}

/// tower's retry as its docs write one: up to 2 retries of a 5xx or an error, each paid from a
/// TPS budget that every request deposits into.
#[derive(Clone)]
struct TowerAttempts {
    left: usize,
    budget: Arc<tower::retry::budget::TpsBudget>,
}

impl<Res, E> tower::retry::Policy<http::Request<Full<Bytes>>, http::Response<Res>, E>
    for TowerAttempts
{
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _: &mut http::Request<Full<Bytes>>,
        result: &mut Result<http::Response<Res>, E>,
    ) -> Option<Self::Future> {
        let failed = match result {
            Ok(response) => response.status().is_server_error(),
            Err(_) => true,
        };
        paid_retry(failed, &mut self.left, &self.budget)
    }

    fn clone_request(
        &mut self,
        request: &http::Request<Full<Bytes>>,
    ) -> Option<http::Request<Full<Bytes>>> {
        Some(copy_of(request))
    }
}

/// A tower retry policy's answer after an attempt that `failed` or not: a success deposits
/// into `budget`; a failure is retried while `left` allows and `budget` pays.
pub(crate) fn paid_retry(
    failed: bool,
    left: &mut usize,
    budget: &tower::retry::budget::TpsBudget,
) -> Option<std::future::Ready<()>> {
    use tower::retry::budget::Budget;
    if !failed {
        budget.deposit();
        return None;
    }
    if *left == 0 || !budget.withdraw() {
        return None;
    }
    *left -= 1;
    Some(std::future::ready(()))
}

/// A copy of `request`, its `Full` body cloned by reference count.
pub(crate) fn copy_of(request: &http::Request<Full<Bytes>>) -> http::Request<Full<Bytes>> {
    let mut copy = http::Request::new(request.body().clone());
    *copy.method_mut() = request.method().clone();
    *copy.uri_mut() = request.uri().clone();
    *copy.version_mut() = request.version();
    *copy.headers_mut() = request.headers().clone();
    copy
}
