//! The second front door: [`RetryMiddleware`] as a tower [`Layer`], for HTTP clients built as a
//! [`Service`] of `http::Request`s (hyper-util's client, a `tower::ServiceBuilder` stack).
//!
//! The layer is the same middleware: the same dependencies, clock, random source, observer and
//! log levels, the same core and the same driver, which is generic over the door. This door
//! hands the driver its caller's `http::Request` as it is (its body made a [`SendBody`], which
//! is copied for another attempt by reference count when it is whole in memory); each copy goes
//! down to the inner service as such a request, and each answer comes back as the inner service's
//! `http::Response`, its body passed on as it is in a [`RetryBody`], through the same judging,
//! waiting, record and tracing as on the reqwest side. No `reqwest::Request`, `Url` or
//! `reqwest::Response` is made. What differs is where a copy goes ([`Inner`]), how a request is
//! copied and named (its `Outgoing` impl), how an answer's body is read (its `Reply` impl),
//! and how the inner service's errors are read (`service_fault`: by their causes, and
//! hyper-util's connect failures as nothing sent); the inner service's own error is what a
//! classifier and a give-up's sources see.
//!
//! Bodies: a body whose frames are all at hand when the request is made (`Full<Bytes>`, a
//! `String`, an empty one) is kept as `Bytes` for a retry or a hedge; one that streams is sent
//! once, as on the reqwest side, and the record says why nothing was retried.
//!
//! One layer retries: each copy carries a mark in its extensions, and an instance of the layer
//! further in that sees it sends the request on untouched.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Extensions;
use tower_layer::Layer;
use tower_service::Service;

mod body;
mod send_body;
mod uri;

pub use body::RetryBody;
pub use send_body::SendBody;

use crate::driver::body::{Prefix, Reply};
use crate::driver::claim::{Address, Beneath, Outgoing};
use crate::driver::phases::RetryMiddleware;
use crate::engine::seen::{Failure, Locate, ResponseHead, Seen};
use crate::error::RetryError;
use crate::fault::{self, Fault};
use http_body::Body as _;

/// An error of the inner service or of the layer, as tower passes errors: boxed.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<S> Layer<S> for RetryMiddleware {
    type Service = RetryService<S>;

    /// Wraps `inner`: every request through the returned service is retried as this middleware
    /// retries the requests of a `reqwest-middleware` chain.
    fn layer(&self, inner: S) -> RetryService<S> {
        RetryService {
            retry: Arc::new(self.clone()),
            inner: Arc::new(inner),
        }
    }
}

/// A tower [`Service`] that retries what is safe to repeat, made by [`RetryMiddleware`] as a
/// [`Layer`] (feature `tower`).
///
/// Use it when your client is a tower service of `http::Request`s (hyper-util's, or a stack
/// built on one); for a `reqwest::Client`, put the [`RetryMiddleware`] itself in a
/// `reqwest-middleware` chain, which costs less (see the README's cost section). Both are
/// configured the same way, on the middleware and its [`Dependency`](crate::Dependency).
///
/// It takes an `http::Request<B>` of any body `B` (`Full<Bytes>`, a `String`, a stream) and an
/// absolute URI, and sends each attempt to the inner service as an
/// `http::Request<`[`SendBody<B>`](SendBody)`>`: the caller's bytes shared by every copy when the
/// body is whole in memory, else the caller's body sent once; the inner
/// service answers with an `http::Response<R>` of any `Unpin` body (wrap another in
/// `Box::pin`). The answer comes back as an `http::Response<RetryBody<R>>`, the inner body
/// passed on as it comes unless the layer read it, carrying the same
/// [`RetryRecord`](crate::RetryRecord) in its extensions
/// ([`RetryRecord::of`](crate::RetryRecord::of) reads it), and an error as a boxed error: a
/// [`RetryError`](crate::RetryError) when the layer made the attempts
/// (`err.downcast_ref::<RetryError>()`), else the inner service's error as it was.
///
/// ```
/// use reqwest_safe_retry::{RetryMiddleware, RetryPolicy};
/// use tower_layer::Layer;
///
/// let connector = hyper_util::client::legacy::connect::HttpConnector::new();
/// let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
///     .build::<_, reqwest_safe_retry::SendBody<String>>(connector);
/// let retrying = RetryMiddleware::new(RetryPolicy::default()).layer(client);
/// # drop(retrying);
/// ```
///
/// `poll_ready` is always ready: each attempt waits for its own clone of the inner service to
/// be ready, so a retry never reuses a readiness it did not wait for. A hedge is decided, counted
/// and paid for only once its clone of the inner service says it is ready: under a concurrency
/// limit that the first copy fills, the hedge waits, unpaid, and is never sent if the first
/// copy answers first. The service takes any
/// body `B`, so a call to `poll_ready` before the request is at hand names it:
/// `Service::<http::Request<String>>::poll_ready(&mut service, cx)`.
#[derive(Debug, Clone)]
pub struct RetryService<S> {
    retry: Arc<RetryMiddleware>,
    /// Shared by the clones of this service and the requests in flight: each attempt calls a
    /// clone of its own.
    inner: Arc<S>,
}

impl<S, B, R> Service<http::Request<B>> for RetryService<S>
where
    S: Service<http::Request<SendBody<B>>, Response = http::Response<R>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Into<Bytes>,
    B::Error: Into<BoxError>,
    R: http_body::Body + Unpin + Send + Sync + 'static,
    R::Data: Into<Bytes>,
    R::Error: Into<BoxError>,
{
    type Response = http::Response<RetryBody<R>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // The extensions stay with the driver, as a chain's do, and go with each copy; the
        // request itself goes to the driver as it is, its body kept whole in memory when all of
        // it is at hand (a copy for a retry then clones its bytes), else sent once.
        let (mut parts, body) = request.into_parts();
        if let Err(e) = absolute(&parts.uri) {
            return Box::pin(std::future::ready(Err(e)));
        }
        let mut extensions = std::mem::take(&mut parts.extensions);
        let inner = Inner {
            service: self.inner.clone(),
            body: std::marker::PhantomData,
        };
        let request = http::Request::from_parts(parts, SendBody::new(body));
        let claimed = extensions.get::<Claimed>().is_some()
            || crate::driver::claim::claimed(&extensions, &request);
        if claimed {
            // A layer further out on this request's path makes its attempts.
            return Box::pin(
                async move { inner.run(request, &mut extensions).await.map_err(boxed) },
            );
        }
        // The future owns the middleware, the extensions and a handle on the inner service: it
        // is one allocation in the allocator's fast size class, written into its place as it is
        // made (not made beside it and copied there).
        let place = Box::new_uninit();
        let run = RetryMiddleware::execute(self.retry.clone(), request, extensions, inner);
        let handed: Box<Handed<_>> = Box::write(place, Handed { run });
        Box::into_pin(handed)
    }
}

pin_project_lite::pin_project! {
    /// The driver's outcome handed back as the layer answers: not an `async` block, which
    /// would hold the driver's future twice (as captured, and as awaited).
    struct Handed<F> {
        #[pin]
        run: F,
    }
}

impl<F, A> Future for Handed<F>
where
    F: Future<Output = reqwest_middleware::Result<A>>,
{
    type Output = Result<A, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let outcome = std::task::ready!(self.project().run.poll(cx));
        Poll::Ready(outcome.map_err(boxed))
    }
}

/// An error as the layer hands it back: the [`RetryError`] when the layer made the attempts,
/// the inner service's own error when it passed the request through, reqwest's when the
/// request could not be made.
fn boxed(err: reqwest_middleware::Error) -> BoxError {
    match err {
        reqwest_middleware::Error::Reqwest(e) => Box::new(e),
        reqwest_middleware::Error::Middleware(e) => match e.downcast::<RetryError>() {
            Ok(retry) => Box::new(retry),
            Err(e) => match e.downcast::<ServiceError>() {
                Ok(ServiceError(inner)) => inner,
                Err(e) => e.into(),
            },
        },
    }
}

/// The mark a copy carries down to the inner service: a layer made of this crate further in
/// passes the request through.
#[derive(Debug, Clone, Copy)]
struct Claimed;

/// The inner service, as the driver sends copies to it: each copy to a clone of its own, with
/// a body made from the caller's `B`.
struct Inner<S, B> {
    service: Arc<S>,
    body: std::marker::PhantomData<fn() -> B>,
}

pin_project_lite::pin_project! {
    /// A copy on its way to the inner service: its call, or, while the service is not ready,
    /// the service asked again with the copy waiting (boxed: rare), or the error that the
    /// service gave when asked.
    #[project = CallNow]
    pub(crate) enum Call<S, Q, F> {
        Called {
            #[pin]
            call: F,
        },
        Waiting {
            waiting: Box<(S, Option<Q>)>,
        },
        Failed {
            error: Option<BoxError>,
        },
    }
}

impl<S, Q, R> Future for Call<S, Q, S::Future>
where
    S: Service<Q, Response = http::Response<R>>,
    S::Error: Into<BoxError>,
{
    type Output = reqwest_middleware::Result<http::Response<RetryBody<R>>>;

    /// The inner service's answer, its body passed on as it comes, or its error, judged by
    /// its causes. Turns at most twice: asked until ready, then called.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let failed = |e: BoxError| reqwest_middleware::Error::middleware(ServiceError(e));
        loop {
            let call = match self.as_mut().project() {
                CallNow::Called { call } => {
                    let answer = std::task::ready!(call.poll(cx));
                    return Poll::Ready(match answer {
                        Ok(response) => Ok(response.map(RetryBody::inner)),
                        Err(e) => Err(failed(e.into())),
                    });
                }
                CallNow::Failed { error } => {
                    let Some(error) = error.take() else {
                        panic!("a copy's call was polled after it ended");
                    };
                    return Poll::Ready(Err(failed(error)));
                }
                CallNow::Waiting { waiting } => {
                    let (service, request) = &mut **waiting;
                    if let Err(e) = std::task::ready!(service.poll_ready(cx)) {
                        return Poll::Ready(Err(failed(e.into())));
                    }
                    let Some(request) = request.take() else {
                        unreachable!("a waiting copy is called once, as it stops waiting");
                    };
                    service.call(request)
                }
            };
            self.set(Call::Called { call });
        }
    }
}

/// Whether the layer can send a request to `uri`: one with a scheme and a host, as a client
/// needs; else the error that says so.
fn absolute(uri: &http::Uri) -> Result<(), BoxError> {
    if uri.scheme().is_some() && uri.authority().is_some() {
        return Ok(());
    }
    Err(format!(
        "the retry layer needs an absolute URI, with a scheme and a host (http://host/path), \
         as a client does; got {uri:?}"
    )
    .into())
}

/// A request of the tower door, as the driver keeps and copies it: an `http::Request` whose
/// body is a [`SendBody`], copied for another attempt when that body is whole in memory (its
/// bytes cloned by reference count).
impl<B: Send + 'static> Outgoing for http::Request<SendBody<B>> {
    fn method(&self) -> &http::Method {
        http::Request::method(self)
    }

    fn headers(&self) -> &http::HeaderMap {
        http::Request::headers(self)
    }

    fn headers_mut(&mut self) -> &mut http::HeaderMap {
        http::Request::headers_mut(self)
    }

    fn whole_body(&self) -> bool {
        self.body().as_bytes().is_some()
    }

    /// A copy without the extensions: the driver keeps them, and hands each copy its own.
    fn try_clone(&self) -> Option<Self> {
        let bytes = self.body().as_bytes()?;
        let mut copy = http::Request::new(SendBody::whole(bytes.clone()));
        *copy.method_mut() = self.method().clone();
        *copy.version_mut() = self.version();
        *copy.uri_mut() = self.uri().clone();
        // The headers `Request::new` gave: a map that never allocated, forgotten rather than
        // dropped (its drop walks its empty parts, about 50 instructions a copy).
        let empty = std::mem::replace(copy.headers_mut(), self.headers().clone());
        if empty.capacity() == 0 {
            std::mem::forget(empty);
        }
        Some(copy)
    }

    fn locate(&self) -> &dyn Locate {
        http::Request::uri(self)
    }

    fn address(&self) -> Address<'_> {
        uri::address_of(http::Request::uri(self))
    }

    fn uri(&self) -> http::Uri {
        http::Request::uri(self).clone()
    }

    /// Of the URL's text as `Url::as_str` writes it, read from the URI's parts in place.
    fn fingerprint(&self) -> u64 {
        uri::fingerprint(self.method(), http::Request::uri(self))
    }

    type Gone = http::Uri;

    fn gone(&self) -> http::Uri {
        http::Request::uri(self).clone()
    }

    /// Parsed only for the error of a request that gives up.
    fn url_of(gone: &http::Uri) -> Option<reqwest::Url> {
        reqwest::Url::parse(&gone.to_string()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        RetryMiddleware::new(crate::RetryPolicy::default()).layer(gate.clone())
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
        let retry = err.downcast_ref::<RetryError>().expect("the layer's error");
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
}

/// An error of the inner service: judged by its causes (a refused or reset connection, a
/// timeout, a response cut short, an HTTP/2 refusal), as a transport error is.
#[derive(Debug)]
pub(crate) struct ServiceError(pub(crate) BoxError);

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ServiceError {
    /// The inner service's own error, so a caller walking the sources of a
    /// [`RetryError`] finds it and can downcast to it.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

impl<S, B, R> Beneath for Inner<S, B>
where
    S: Service<http::Request<SendBody<B>>, Response = http::Response<R>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Send + 'static,
    R: http_body::Body + Unpin + Send + Sync + 'static,
    R::Data: Into<Bytes>,
    R::Error: Into<BoxError>,
{
    type Request = http::Request<SendBody<B>>;
    type Reply = http::Response<RetryBody<R>>;

    /// The inner service's call, held as it is.
    type Running<'s>
        = Call<S, Self::Request, S::Future>
    where
        Self: 's;

    /// A clone of the inner service, asked with the request's own waker until it is ready.
    type Ready = S;

    fn poll_ready(&self, ready: &mut Option<S>, cx: &mut Context<'_>) -> Poll<bool> {
        let service = ready.get_or_insert_with(|| S::clone(&self.service));
        match service.poll_ready(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(true),
            Poll::Ready(Err(_)) => {
                *ready = None;
                Poll::Ready(false)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn run_ready<'s>(
        &'s self,
        mut ready: S,
        request: Self::Request,
        extensions: &'s mut Extensions,
    ) -> Self::Running<'s> {
        Call::Called {
            call: ready.call(marked(request, extensions)),
        }
    }

    fn run<'s>(
        &'s self,
        request: Self::Request,
        extensions: &'s mut Extensions,
    ) -> Self::Running<'s> {
        let mut service = S::clone(&self.service);
        let request = marked(request, extensions);
        // Most services are ready at once (a client's pool takes any number of requests): then
        // the copy is handed over here, under the claim's mark like the rest of the attempt,
        // and only the call's own future is held. One that is not is asked again, by the
        // attempt's task, before the copy goes.
        let mut asking = Context::from_waker(std::task::Waker::noop());
        match service.poll_ready(&mut asking) {
            Poll::Ready(Ok(())) => Call::Called {
                call: service.call(request),
            },
            Poll::Ready(Err(e)) => Call::Failed {
                error: Some(e.into()),
            },
            Poll::Pending => Call::Waiting {
                waiting: Box::new((service, Some(request))),
            },
        }
    }

    /// An answer came from where its request went (`to`): the inner service's answer does not
    /// say.
    fn seen<'o>(
        &'o self,
        outcome: &'o reqwest_middleware::Result<Self::Reply>,
        to: &'o dyn Locate,
    ) -> Seen<'o> {
        match outcome {
            Ok(response) => Seen::Answer(ResponseHead {
                status: response.status(),
                version: response.version(),
                headers: response.headers(),
                from: to,
            }),
            Err(reqwest_middleware::Error::Middleware(e)) if e.is::<ServiceError>() => {
                let Some(service) = e.downcast_ref::<ServiceError>() else {
                    unreachable!("the error was just found to be the inner service's");
                };
                // The inner service's own error, for the classifier to look into.
                Seen::Failed(Failure {
                    fault: service_fault(service),
                    error: &*service.0,
                })
            }
            Err(err) => Seen::Failed(crate::door::reqwest::failure(err)),
        }
    }
}

/// The copy as the inner service takes it: the request's extensions, with the mark that tells
/// an instance further in to pass it through.
fn marked<B>(mut request: http::Request<B>, extensions: &Extensions) -> http::Request<B> {
    *request.extensions_mut() = extensions.clone();
    request.extensions_mut().insert(Claimed);
    request
}

/// An answer of the tower door: the inner service's, its body read a frame at a time, and
/// replaced in place by what was read of it.
impl<R> Reply for http::Response<RetryBody<R>>
where
    R: http_body::Body + Unpin + Send + Sync + 'static,
    R::Data: Into<Bytes>,
    R::Error: Into<BoxError>,
{
    fn status(&self) -> http::StatusCode {
        http::Response::status(self)
    }

    fn headers(&self) -> &http::HeaderMap {
        http::Response::headers(self)
    }

    fn headers_mut(&mut self) -> &mut http::HeaderMap {
        http::Response::headers_mut(self)
    }

    fn extensions_mut(&mut self) -> &mut Extensions {
        http::Response::extensions_mut(self)
    }

    fn content_length(&self) -> Option<u64> {
        http_body::Body::size_hint(self.body()).exact()
    }

    fn chunk(
        &mut self,
    ) -> impl Future<Output = Result<Option<Bytes>, reqwest_middleware::Error>> + Send {
        std::future::poll_fn(|cx| {
            // Bounded by what the body has ready: a frame that is not data (trailers) is
            // passed over, and the next one polled at once.
            loop {
                let frame = std::task::ready!(Pin::new(self.body_mut()).poll_frame(cx));
                match frame {
                    None => return Poll::Ready(Ok(None)),
                    // Judged as the inner service's errors are: by their causes.
                    Some(Err(e)) => {
                        let cut = reqwest_middleware::Error::middleware(ServiceError(e));
                        return Poll::Ready(Err(cut));
                    }
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            return Poll::Ready(Ok(Some(data)));
                        }
                    }
                }
            }
        })
    }

    fn read_whole(self, body: Bytes) -> Self {
        self.map(|_| RetryBody::whole(body))
    }

    fn read_first(self, read: Prefix) -> Self {
        self.map(|rest| rest.after(read))
    }
}

/// The transient fault behind a tower service's error: the same causes as behind reqwest's,
/// and a connect failure of hyper-util's client told apart as reqwest's is (nothing was sent).
fn service_fault(err: &ServiceError) -> Option<Fault> {
    let err: &(dyn std::error::Error + 'static) = &*err.0;
    let cause = fault::of_causes(err);
    let mut source = Some(err);
    // Bounded, as every walk of a chain here.
    for _ in 0..64 {
        let Some(at) = source else { break };
        if let Some(client) = at.downcast_ref::<hyper_util::client::legacy::Error>() {
            if client.is_connect() {
                let passing = cause.is_some() || fault::resolution_failed(err);
                return passing.then_some(Fault::Connect);
            }
        }
        source = at.source();
    }
    cause
}
