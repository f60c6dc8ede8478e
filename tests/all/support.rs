//! Shared test helpers: clients on a fake clock, and a raw-TCP server for faults that a
//! well-behaved HTTP server cannot produce.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{Dependency, FakeClock, RetryMiddleware, RetryPolicy, SeededRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

/// A policy with the defaults, except a short attempt timeout so a stuck test fails fast.
pub fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// A client whose retries wait on a fake clock with seeded jitter; returns the clock to inspect.
pub fn client_with(policy: RetryPolicy) -> (ClientWithMiddleware, FakeClock) {
    let clock = FakeClock::new();
    let middleware = RetryMiddleware::new(policy)
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(7));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();
    (client, clock)
}

/// A client on the real clock, for per-attempt timeouts against real slow servers (a
/// `FakeClock` fires them only when a test moves its time). Waits between attempts are at most
/// 5 ms, so a test stays fast.
pub fn real_time_client(attempt_timeout: Duration) -> ClientWithMiddleware {
    let policy = RetryPolicy::builder()
        .attempt_timeout(attempt_timeout)
        .base_delay(Duration::from_millis(1))
        .max_delay(Duration::from_millis(5))
        .build()
        .unwrap();
    let middleware = RetryMiddleware::new(policy).with_rng(SeededRng::new(7));
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build()
}

pub fn client() -> (ClientWithMiddleware, FakeClock) {
    client_with(policy())
}

/// hyper-util's client for plain HTTP, of `reqwest::Body` requests: what the tower door's tests
/// put beneath the layer.
#[cfg(feature = "tower")]
pub fn hyper_client<B>()
-> hyper_util::client::legacy::Client<hyper_util::client::legacy::connect::HttpConnector, B>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
{
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// A client that neither stamps nor recognises idempotency keys: safety by method alone.
pub fn unkeyed_client() -> (ClientWithMiddleware, FakeClock) {
    let clock = FakeClock::new();
    let middleware =
        RetryMiddleware::new(Dependency::new("default", policy()).without_idempotency_keys())
            .with_clock(clock.clone())
            .with_rng(SeededRng::new(7));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();
    (client, clock)
}

/// What the raw server does with one request.
#[derive(Debug, Clone)]
pub enum Action {
    /// Writes these bytes as the whole response, then closes.
    Respond(Vec<u8>),
    /// Writes these bytes, then resets the connection (RST, not FIN).
    WriteThenReset(Vec<u8>),
    /// Closes the connection without a byte of response.
    Close,
    /// Waits this long (real time), then writes these bytes.
    Delay(Duration, Vec<u8>),
    /// Writes the head, then one byte of its body every interval (real time) for as long as
    /// the connection lasts, or until the body's bytes run out. (Its scenario runs through both
    /// doors, so only with the `tower` feature.)
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    Trickle(Vec<u8>, Duration, usize),
}

/// A complete `200 OK` with `body`, closing the connection.
pub fn ok(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A raw HTTP/1.1 server on 127.0.0.1: request `n` (0-based) gets `script[n]`, or the last
/// entry once the script runs out. One request per connection.
#[derive(Debug, Clone)]
pub struct RawServer {
    pub addr: std::net::SocketAddr,
    requests: Arc<AtomicUsize>,
    bodies: Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
    arrivals: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>,
}

impl RawServer {
    pub async fn start(script: Vec<Action>) -> RawServer {
        assert!(!script.is_empty());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = RawServer {
            addr: listener.local_addr().unwrap(),
            requests: Arc::default(),
            bodies: Arc::default(),
            arrivals: Arc::default(),
        };
        let (requests, bodies) = (server.requests.clone(), server.bodies.clone());
        let arrivals = server.arrivals.clone();
        let script = Arc::new(script);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (requests, bodies, script) = (requests.clone(), bodies.clone(), script.clone());
                let arrivals = arrivals.clone();
                tokio::spawn(async move {
                    serve(stream, &requests, &bodies, &arrivals, &script).await;
                });
            }
        });
        server
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// How many complete requests the server has read.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// When each request read so far arrived, on tokio's clock (paused or not).
    pub fn arrivals(&self) -> Vec<tokio::time::Instant> {
        self.arrivals.lock().unwrap().clone()
    }

    /// The bodies of the requests read so far.
    pub fn bodies(&self) -> Vec<Vec<u8>> {
        self.bodies.lock().unwrap().clone()
    }
}

async fn serve(
    mut stream: TcpStream,
    requests: &AtomicUsize,
    bodies: &std::sync::Mutex<Vec<Vec<u8>>>,
    arrivals: &std::sync::Mutex<Vec<tokio::time::Instant>>,
    script: &[Action],
) {
    let Some(request) = read_request(&mut stream).await else {
        return;
    };
    arrivals.lock().unwrap().push(tokio::time::Instant::now());
    bodies.lock().unwrap().push(request.body);
    let n = requests.fetch_add(1, Ordering::SeqCst);
    let action = script[n.min(script.len() - 1)].clone();
    match action {
        Action::Respond(bytes) => {
            let _ = stream.write_all(&bytes).await;
            let _ = stream.shutdown().await;
        }
        Action::WriteThenReset(bytes) => {
            let _ = stream.write_all(&bytes).await;
            let _ = stream.flush().await;
            // Give the bytes time to leave before the reset discards the send buffer.
            tokio::time::sleep(Duration::from_millis(20)).await;
            reset(stream).await;
        }
        Action::Close => {
            let _ = stream.shutdown().await;
        }
        Action::Delay(wait, bytes) => {
            tokio::time::sleep(wait).await;
            let _ = stream.write_all(&bytes).await;
            let _ = stream.shutdown().await;
        }
        Action::Trickle(head, every, bytes) => {
            if stream.write_all(&head).await.is_err() {
                return;
            }
            for _ in 0..bytes {
                tokio::time::sleep(every).await;
                if stream.write_all(b"x").await.is_err() {
                    return;
                }
            }
            let _ = stream.shutdown().await;
        }
    }
}

/// One HTTP/1.1 request as it arrived.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub method: String,
    pub path: String,
    /// Header names lowercased, values byte for byte.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl ParsedRequest {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
}

/// Reads one request (head, then a content-length or chunked body).
pub async fn read_request(stream: &mut TcpStream) -> Option<ParsedRequest> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let mut body = buf.split_off(head_end);
    let mut lines = buf[..head_end - 4].split(|b| *b == b'\n');
    let request_line = String::from_utf8_lossy(lines.next()?).trim().to_owned();
    let mut parts = request_line.split(' ');
    let (method, path) = (parts.next()?.to_owned(), parts.next()?.to_owned());
    let headers: Vec<(String, Vec<u8>)> = lines
        .filter_map(|line| {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let colon = line.iter().position(|b| *b == b':')?;
            let name = String::from_utf8_lossy(&line[..colon]).to_ascii_lowercase();
            let value = line[colon + 1..].trim_ascii().to_vec();
            Some((name, value))
        })
        .collect();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).to_ascii_lowercase())
    };
    if let Some(len) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while body.len() < len {
            let n = stream.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        while find(&body, b"0\r\n\r\n").is_none() {
            let n = stream.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            body.extend_from_slice(&chunk[..n]);
        }
        body = dechunk(&body);
    }
    Some(ParsedRequest {
        method,
        path,
        headers,
        body,
    })
}

/// Resets the connection: RST instead of an orderly close.
pub async fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = find(raw, b"\r\n") {
        let size = usize::from_str_radix(std::str::from_utf8(&raw[..line_end]).unwrap().trim(), 16)
            .unwrap();
        if size == 0 {
            break;
        }
        let start = line_end + 2;
        out.extend_from_slice(&raw[start..start + size]);
        raw = &raw[start + size + 2..];
    }
    out
}

/// A port on 127.0.0.1 that refuses connections: bound, never listening, held for the run.
pub async fn refused_port() -> u16 {
    // Bound and never listening: a connection to it is refused. Held for the rest of the run,
    // so that no other test's listener can be given the port meanwhile (a port bound and let go
    // at once was, now and then, under load).
    static HELD: std::sync::Mutex<Vec<tokio::net::TcpSocket>> = std::sync::Mutex::new(Vec::new());
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = socket.local_addr().unwrap().port();
    HELD.lock().unwrap().push(socket);
    port
}

/// A URL on 127.0.0.1 whose port refuses connections.
pub async fn refused_url() -> String {
    format!("http://127.0.0.1:{}/", refused_port().await)
}

/// How a logical request that ended in `response` ended: its attempts and its stop reason.
pub fn ended(response: &reqwest::Response) -> (u32, reqwest_safe_retry::StopReason) {
    let record = reqwest_safe_retry::RetryRecord::of(response).expect("a record");
    (record.attempts(), record.stop_reason())
}

/// A wiremock server on 127.0.0.1 that answers every request with `code`.
pub async fn always(code: u16) -> MockServer {
    first_then(ResponseTemplate::new(code), 0, ResponseTemplate::new(code)).await
}

/// A wiremock server that answers the first `times` requests with `first`, then `then`.
pub async fn first_then(first: ResponseTemplate, times: u64, then: ResponseTemplate) -> MockServer {
    let server = MockServer::start().await;
    if times > 0 {
        Mock::given(any())
            .respond_with(first)
            .up_to_n_times(times)
            .mount(&server)
            .await;
    }
    Mock::given(any()).respond_with(then).mount(&server).await;
    server
}

/// A middleware that calls its function with each request's extensions as the request passes
/// down the chain: an error it returns is the request's outcome instead of passing it on.
pub struct Before<F>(pub F);

impl<F> reqwest_middleware::Middleware for Before<F>
where
    F: Fn(&mut http::Extensions) -> Option<reqwest_middleware::Error> + Send + Sync + 'static,
{
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
        match (self.0)(extensions) {
            Some(err) => Box::pin(std::future::ready(Err(err))),
            None => next.run(request, extensions),
        }
    }
}

/// A whole 503 response that closes the connection.
pub fn unavailable() -> Vec<u8> {
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec()
}

/// The two doors nested (feature `tower`): a tower service that sends through a
/// reqwest-middleware chain, and a chain's last middleware that sends through a tower service.
#[cfg(feature = "tower")]
mod bridges {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use http::Extensions;
    use reqwest::{Request, Response, ResponseBuilderExt};
    use reqwest_middleware::{ClientWithMiddleware, Middleware, Next};
    use tower_service::Service;

    type BoxError = Box<dyn std::error::Error + Send + Sync>;

    /// A tower service that sends each request through a reqwest-middleware chain.
    #[derive(Clone)]
    pub struct ThroughReqwest(pub ClientWithMiddleware);

    impl<B> Service<http::Request<B>> for ThroughReqwest
    where
        B: http_body::Body + Send + Sync + 'static,
        B::Data: Into<bytes::Bytes>,
        B::Error: Into<BoxError>,
    {
        type Response = http::Response<reqwest::Body>;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<B>) -> Self::Future {
            let client = self.0.clone();
            Box::pin(async move {
                let request = reqwest::Request::try_from(request.map(reqwest::Body::wrap))?;
                let response = client.execute(request).await?;
                Ok(http::Response::from(response))
            })
        }
    }

    /// The last middleware of a chain: sends the request through a tower service instead of
    /// the chain's client.
    pub struct ThroughTower<S>(pub S);

    #[async_trait::async_trait]
    impl<S, R> Middleware for ThroughTower<S>
    where
        S: Service<http::Request<reqwest::Body>, Response = http::Response<R>, Error = BoxError>
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send,
        R: http_body::Body + Send + Sync + 'static,
        R::Data: Into<bytes::Bytes>,
        R::Error: Into<BoxError>,
    {
        async fn handle(
            &self,
            request: Request,
            _: &mut Extensions,
            _: Next<'_>,
        ) -> reqwest_middleware::Result<Response> {
            let url = request.url().clone();
            let request = http::Request::try_from(request)?;
            let answer = self.0.clone().call(request).await;
            let answer = answer.map_err(|e| reqwest_middleware::Error::middleware(Failed(e)))?;
            // The answer keeps its request's URL, as reqwest's own does.
            let (parts, body) = answer.into_parts();
            let body = reqwest::Body::wrap(body);
            let mut rebuilt = http::Response::builder().url(url).body(body).unwrap();
            *rebuilt.status_mut() = parts.status;
            *rebuilt.headers_mut() = parts.headers;
            Ok(Response::from(rebuilt))
        }
    }

    /// The tower service's error, as a middleware's.
    #[derive(Debug)]
    struct Failed(BoxError);

    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            self.0.fmt(f)
        }
    }

    impl std::error::Error for Failed {}
}
#[cfg(feature = "tower")]
pub use bridges::{ThroughReqwest, ThroughTower};

/// A loopback listener that never accepts, its queue already full: a connection to it does
/// not open, and a client's connect timeout fires (nothing is sent).
#[cfg(feature = "tower")]
pub struct FullBacklog {
    address: std::net::SocketAddr,
    /// The listener, and the connection that fills its queue.
    _held: (tokio::net::TcpListener, tokio::net::TcpStream),
}

#[cfg(feature = "tower")]
impl FullBacklog {
    pub async fn start() -> FullBacklog {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        // A backlog of none holds one connection that is not accepted; the next one's opening
        // packets are dropped.
        let listener = socket.listen(0).unwrap();
        let address = listener.local_addr().unwrap();
        let filler = tokio::net::TcpStream::connect(address).await.unwrap();
        FullBacklog {
            address,
            _held: (listener, filler),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}/orders", self.address)
    }
}
