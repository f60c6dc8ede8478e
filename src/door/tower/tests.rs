//! The tower door's own tests: requests named alike behind either door, copies, readiness, and
//! answers read as the other door reads them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Body as _;
use tower_layer::Layer;
use tower_service::Service;

use super::RetryService;
use super::service::absolute;
use crate::driver::body::Reply;
use crate::driver::claim::Claimed;
use crate::driver::claim::Outgoing;
use crate::driver::middleware::RetryMiddleware;
use crate::error::RetryError;
use crate::{body::RetryBody, body::SendBody};

#[test]
fn a_uri_without_a_scheme_or_a_host_is_refused() {
    for uri in ["/orders", "example.com"] {
        let err = absolute(&uri.parse().unwrap()).unwrap_err().to_string();
        assert!(err.contains("absolute URI"), "{uri}: {err}");
    }
    assert!(absolute(&"http://127.0.0.1:8080/orders".parse().unwrap()).is_ok());
}

/// A request is named by the same parts behind either door, so the claim knows it across
/// them and the observer sees the same URL: the scheme's own port left out, an empty path
/// read as `/`.
#[test]
fn a_request_has_the_same_address_and_fingerprint_behind_either_door() {
    let long = format!(
        "http://127.0.0.1:8080/{}?q={}",
        "a".repeat(300),
        "b".repeat(9)
    );
    for (uri, url) in [
        (
            "http://127.0.0.1:8080/orders?id=7",
            "http://127.0.0.1:8080/orders?id=7",
        ),
        ("http://127.0.0.1:80/a", "http://127.0.0.1/a"),
        (
            "https://api.example.com:443/pay",
            "https://api.example.com/pay",
        ),
        ("http://[::1]:9/", "http://[::1]:9/"),
        ("http://h", "http://h/"),
        ("http://h?q=1", "http://h/?q=1"),
        ("https://h:8443/a", "https://h:8443/a"),
        ("http://h:8080/a", "http://h:8080/a"),
        ("http://u:p@h:80/a", "http://u:p@h/a"),
        ("http://h/a?", "http://h/a?"),
        ("https://[::1]:443/a?b=c&d", "https://[::1]/a?b=c&d"),
    ]
    .into_iter()
    .map(|(uri, url)| (uri.to_owned(), url.to_owned()))
    .chain(std::iter::once((long.clone(), long.clone())))
    {
        let tower = http::Request::post(&uri)
            .body(SendBody::<String>::whole(Bytes::from_static(b"x")))
            .unwrap();
        let reqwest = reqwest::Request::new("POST".parse().unwrap(), url.parse().unwrap());
        let (a, b) = (tower.address(), reqwest.address());
        assert_eq!(
            (a.scheme, a.host, a.port, a.known_port, a.path),
            (b.scheme, b.host, b.port, b.known_port, b.path),
            "{uri}"
        );
        assert_eq!(
            crate::driver::claim::fingerprint(&tower),
            crate::driver::claim::fingerprint(&reqwest),
            "{uri}"
        );
    }
}

#[test]
fn a_copy_carries_the_head_and_the_body_but_not_the_extensions() {
    let body = Bytes::from_static(b"body");
    let mut request = http::Request::put("http://127.0.0.1/x")
        .header("x-a", "1")
        .body(SendBody::new(http_body_util::Full::new(body.clone())))
        .unwrap();
    request.extensions_mut().insert(Claimed);
    let copy = Outgoing::try_clone(&request).unwrap();
    assert_eq!(copy.method(), "PUT");
    assert_eq!(copy.uri(), "http://127.0.0.1/x");
    assert_eq!(copy.headers()["x-a"], "1");
    let copied = copy.body().as_bytes().unwrap();
    assert_eq!(
        (copied, copied.as_ptr()),
        (&body, body.as_ptr()),
        "the bytes, not a copy"
    );
    assert!(copy.extensions().get::<Claimed>().is_none());
    // A body that is not at hand: sent once.
    let streamed = http::Request::new(SendBody::new(Never(1)));
    assert!(!streamed.whole_body() && Outgoing::try_clone(&streamed).is_none());
}

/// A service that is not ready for its first `busy` asks (and wakes its asker each time),
/// or that fails its asks (`broken`), and answers 200 to every call; it counts both.
#[derive(Clone)]
struct Gate {
    busy: Arc<std::sync::atomic::AtomicUsize>,
    broken: bool,
    asked: Arc<std::sync::atomic::AtomicUsize>,
    called: Arc<std::sync::atomic::AtomicUsize>,
}

impl Gate {
    fn new(busy: usize, broken: bool) -> Gate {
        Gate {
            busy: Arc::new(busy.into()),
            broken,
            asked: Arc::default(),
            called: Arc::default(),
        }
    }
}

impl<Q> Service<Q> for Gate {
    type Response = http::Response<http_body_util::Full<Bytes>>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<Self::Response, std::io::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
        use std::sync::atomic::Ordering::SeqCst;
        self.asked.fetch_add(1, SeqCst);
        if self.broken {
            return Poll::Ready(Err(std::io::Error::other("the gate is broken")));
        }
        let busy = self.busy.load(SeqCst);
        if busy > 0 {
            self.busy.store(busy - 1, SeqCst);
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Q) -> Self::Future {
        self.called
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        std::future::ready(Ok(http::Response::new(http_body_util::Full::new(
            Bytes::from_static(b"done"),
        ))))
    }
}

fn layered(gate: &Gate) -> RetryService<Gate> {
    RetryMiddleware::new(crate::engine::policy::RetryPolicy::default()).layer(gate.clone())
}

/// A service ready at once is called once per attempt; one that is not yet ready is asked
/// again by the attempt's task until it is, and only then called.
#[tokio::test]
async fn the_inner_service_is_called_only_once_it_is_ready() {
    use http_body_util::BodyExt;
    use std::sync::atomic::Ordering::SeqCst;
    for busy in [0, 1, 3] {
        let gate = Gate::new(busy, false);
        let request = http::Request::get("http://127.0.0.1:9/x").body(String::new());
        let answer = layered(&gate).call(request.unwrap()).await.unwrap();
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "done", "{busy} asks answered not ready");
        assert_eq!(gate.asked.load(SeqCst), busy + 1, "{busy}");
        assert_eq!(gate.called.load(SeqCst), 1, "{busy}");
    }
}

/// A service that fails to become ready fails the attempt with its own error, which is not
/// a transport fault: the request gives up at once, and its error leads to the service's.
#[tokio::test]
async fn a_service_that_fails_its_readiness_fails_the_attempt_with_its_error() {
    use std::sync::atomic::Ordering::SeqCst;
    let gate = Gate::new(0, true);
    let request = http::Request::get("http://127.0.0.1:9/x").body(String::new());
    let err = layered(&gate).call(request.unwrap()).await.unwrap_err();
    let retry = RetryError::of_boxed(&err).expect("the layer's error");
    assert_eq!(retry.attempts(), 1);
    let mut source = std::error::Error::source(retry);
    let mut found = false;
    for _ in 0..8 {
        let Some(at) = source else { break };
        found |= at.to_string() == "the gate is broken";
        source = at.source();
    }
    assert!(found, "{retry:?}");
    assert_eq!((gate.asked.load(SeqCst), gate.called.load(SeqCst)), (1, 0));
}

/// A body that declares a length and never gives a byte.
struct Never(u64);

impl http_body::Body for Never {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        Poll::Pending
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.0)
    }
}

/// An answer of this door is read as the reqwest door's is: a body declared over the limit
/// is handed back unread, at once; one kept through a wait that does not fit is dropped with
/// the `Content-Length` that promised it.
#[test]
fn an_answer_s_body_is_read_and_kept_as_on_the_other_door() {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let answer = |declared| {
        let mut answer = http::Response::new(RetryBody::inner(Never(declared)));
        answer
            .headers_mut()
            .insert("content-length", declared.into());
        answer
    };
    assert_eq!(Reply::content_length(&answer(9)), Some(9));
    let read = std::pin::pin!(crate::driver::body::buffer(answer(9), 8));
    let Poll::Ready(Ok((unread, None))) = read.poll(&mut cx) else {
        panic!("a body declared over the limit is handed back unread, at once");
    };
    assert_eq!(unread.headers()["content-length"], "9");
    let now = std::pin::pin!(std::future::ready(()));
    let kept = crate::driver::body::keep(Ok(answer(9)), 8, now);
    let Poll::Ready(Ok(kept)) = std::pin::pin!(kept).poll(&mut cx) else {
        panic!("keeping a body that does not fit ends at once");
    };
    assert!(kept.headers().get("content-length").is_none());
    assert!(kept.body().is_end_stream());
    assert_eq!(kept.body().size_hint().exact(), Some(0));
}
