//! The second front door: [`RetryMiddleware`] as a tower [`Layer`], for HTTP clients built as a
//! [`Service`] of `http::Request`s (hyper-util's client, a `tower::ServiceBuilder` stack).
//!
//! The layer is the same middleware: the same dependencies, clock, random source, observer and
//! log levels, the same core and the same driver. A request is turned into a `reqwest::Request`
//! once, at the door; each copy of it goes down to the inner service as an `http::Request`
//! whose body is a [`reqwest::Body`], and each answer comes back through the same judging,
//! waiting, record and tracing as on the reqwest side. What differs is only where a copy goes
//! ([`Inner`]) and how the inner service's errors are read (`service_fault`: by their causes,
//! and hyper-util's connect failures as nothing sent), and the inner service's own error is
//! what a classifier and a give-up's sources see.
//!
//! Bodies: a body that is whole in memory (`Bytes`, `Vec<u8>`, `String`, a `&'static str`, an
//! empty one) is kept for a retry or a hedge; a [`reqwest::Body`] made from a stream is sent
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

use crate::driver::body::Reply;
use crate::driver::claim::Beneath;
use crate::driver::phases::RetryMiddleware;
use crate::engine::seen::{Failure, Locate, ResponseHead, Seen, Target};
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
            inner,
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
/// It takes an `http::Request<B>` whose body converts into a [`reqwest::Body`] (`Bytes`,
/// `Vec<u8>`, `String`, `&'static str`, or a `reqwest::Body` itself) and an absolute URI, and
/// sends each attempt to the inner service as an `http::Request<reqwest::Body>`; the inner
/// service answers with an `http::Response` of any body. The answer comes back as an
/// `http::Response<reqwest::Body>` carrying the same [`RetryRecord`](crate::RetryRecord) in its
/// extensions ([`RetryRecord::of`](crate::RetryRecord::of) reads it), and an error as a
/// boxed error: a [`RetryError`](crate::RetryError) when the layer made the attempts
/// (`err.downcast_ref::<RetryError>()`), else the inner service's error as it was.
///
/// ```
/// use reqwest_safe_retry::{RetryMiddleware, RetryPolicy};
/// use tower_layer::Layer;
///
/// let connector = hyper_util::client::legacy::connect::HttpConnector::new();
/// let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
///     .build::<_, reqwest::Body>(connector);
/// let retrying = RetryMiddleware::new(RetryPolicy::default()).layer(client);
/// # drop(retrying);
/// ```
///
/// `poll_ready` is always ready: each attempt waits for its own clone of the inner service to
/// be ready, so a retry never reuses a readiness it did not wait for. The service takes any
/// body `B`, so a call to `poll_ready` before the request is at hand names it:
/// `Service::<http::Request<Bytes>>::poll_ready(&mut service, cx)`.
#[derive(Debug, Clone)]
pub struct RetryService<S> {
    retry: Arc<RetryMiddleware>,
    inner: S,
}

impl<S, B, R> Service<http::Request<B>> for RetryService<S>
where
    S: Service<http::Request<reqwest::Body>, Response = http::Response<R>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Into<reqwest::Body>,
    R: http_body::Body + Send + Sync + 'static,
    R::Data: Into<Bytes>,
    R::Error: Into<BoxError>,
{
    type Response = http::Response<reqwest::Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // The extensions stay with the driver, as a chain's do, and go with each copy; the URI
        // too, for the copies (the driver reads the request's URL, parsed once here).
        let (parts, body) = request.into_parts();
        let mut extensions = parts.extensions;
        let inner = Inner {
            service: self.inner.clone(),
            uri: parts.uri,
        };
        let request = url_of(&inner.uri).map(|url| {
            let mut request = reqwest::Request::new(parts.method, url);
            *request.headers_mut() = parts.headers;
            *request.version_mut() = parts.version;
            *request.body_mut() = Some(body.into());
            request
        });
        let request = match request {
            Ok(request) => request,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        let claimed = extensions.get::<Claimed>().is_some()
            || crate::driver::claim::claimed(&extensions, &request);
        if claimed {
            // A layer further out on this request's path makes its attempts.
            return Box::pin(
                async move { inner.run(request, &mut extensions).await.map_err(boxed) },
            );
        }
        // The future owns the middleware and the extensions, and the inner service boxed (a
        // client is hundreds of bytes): it is one allocation in the allocator's fast size class.
        let run =
            RetryMiddleware::execute(self.retry.clone(), request, extensions, Box::new(inner));
        Box::pin(Handed { run })
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

impl<F> Future for Handed<F>
where
    F: Future<Output = reqwest_middleware::Result<http::Response<reqwest::Body>>>,
{
    type Output = Result<http::Response<reqwest::Body>, BoxError>;

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

/// The inner service, as the driver sends copies to it, and the URI every copy goes to.
struct Inner<S> {
    service: S,
    uri: http::Uri,
}

/// The URL of `uri`, as `Url::parse` reads it. Parsing a host costs most of a URL's parse
/// (and most of a request's cost at this door), and a client sends to few origins: the last
/// origin's URL is kept on the thread, and a request to it costs a copy and its path and query.
fn url_of(uri: &http::Uri) -> Result<reqwest::Url, BoxError> {
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(relative(uri, "no scheme or no host"));
    };
    let origin = LAST_ORIGIN.try_with(|last| {
        let last = last.borrow();
        let (kept_scheme, kept_authority, url) = last.as_ref()?;
        (kept_scheme == scheme && kept_authority == authority.as_str()).then(|| url.clone())
    });
    let mut url = match origin.ok().flatten() {
        Some(url) => url,
        None => {
            let url = reqwest::Url::parse(&format!("{scheme}://{authority}/"))
                .map_err(|e| relative(uri, e))?;
            let kept = (
                scheme.to_owned(),
                authority.as_str().to_owned(),
                url.clone(),
            );
            let _ = LAST_ORIGIN.try_with(|last| *last.borrow_mut() = Some(kept));
            url
        }
    };
    url.set_path(uri.path());
    url.set_query(uri.query());
    Ok(url)
}

thread_local! {
    /// The scheme and authority of the last URI whose URL was made on this thread, and that
    /// URL's origin (see [`url_of`]).
    static LAST_ORIGIN: std::cell::RefCell<Option<(String, String, reqwest::Url)>> =
        const { std::cell::RefCell::new(None) };
}

/// The error for a request whose URI the layer cannot send: one without a scheme or a host.
fn relative(uri: &http::Uri, cause: impl std::fmt::Display) -> BoxError {
    format!(
        "the retry layer needs an absolute URI, with a scheme and a host (http://host/path), \
         as a client does; got {uri:?}: {cause}"
    )
    .into()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::url_of;

    proptest! {
        /// Made from the origin kept on the thread or parsed whole, a URI's URL is the one
        /// `Url::parse` gives: whatever its path and query (dot segments, percent signs,
        /// characters a path must escape), and whichever origin came before it.
        #[test]
        fn a_url_from_the_kept_origin_is_the_parsed_url(
            origins in prop::collection::vec(
                prop::sample::select(vec![
                    "http://127.0.0.1:8080", "http://example.com", "https://example.com",
                    "https://EXAMPLE.com:443",
                    "http://[::1]:9", "http://user:pw@example.com", "http://xn--nxasmq6b.com",
                ]),
                1..4,
            ),
            paths in prop::collection::vec("(/[a-zA-Z0-9._~%!$&'()*+,;=:@|^{}\\-]{0,6}){0,4}", 1..4),
            queries in prop::collection::vec(prop::option::of("[a-zA-Z0-9=&%/?._~'-]{0,8}"), 1..4),
        ) {
            for ((origin, path), query) in origins.iter().zip(&paths).zip(&queries) {
                let mut text = format!("{origin}{path}");
                if let Some(query) = query {
                    text = format!("{text}?{query}");
                }
                let Ok(uri) = text.parse::<http::Uri>() else { continue };
                let parsed = reqwest::Url::parse(&uri.to_string());
                let made = url_of(&uri);
                match (parsed, made) {
                    (Ok(parsed), Ok(made)) => prop_assert_eq!(parsed.as_str(), made.as_str(), "{}", text),
                    (Err(_), Err(_)) => {}
                    (parsed, made) => prop_assert!(false, "{text}: {parsed:?} against {made:?}"),
                }
            }
        }
    }

    /// An origin is its scheme and its authority: the same host under another scheme is not the
    /// kept origin.
    #[test]
    fn the_same_authority_under_another_scheme_is_another_origin() {
        for uri in [
            "http://example.com/a",
            "https://example.com/b",
            "http://example.com/c",
        ] {
            let made = url_of(&uri.parse().unwrap()).unwrap();
            assert_eq!(made.as_str(), uri);
        }
    }

    #[test]
    fn a_uri_without_a_scheme_or_a_host_is_refused() {
        for uri in ["/orders", "example.com"] {
            let err = url_of(&uri.parse().unwrap()).unwrap_err().to_string();
            assert!(err.contains("absolute URI"), "{uri}: {err}");
        }
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

impl<S, R> Beneath for Inner<S>
where
    S: Service<http::Request<reqwest::Body>, Response = http::Response<R>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    R: http_body::Body + Send + Sync + 'static,
    R::Data: Into<Bytes>,
    R::Error: Into<BoxError>,
{
    type Reply = http::Response<reqwest::Body>;

    fn run<'s>(
        &'s self,
        request: reqwest::Request,
        extensions: &'s mut Extensions,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<Self::Reply>> + Send + 's>> {
        let mut service = self.service.clone();
        // The copy as the inner service takes it: the URI as the caller gave it (not parsed
        // again from the URL), the request's extensions with the mark.
        let mut request = request;
        let body = request.body_mut().take();
        let mut copy =
            http::Request::new(body.unwrap_or_else(|| reqwest::Body::from(Bytes::new())));
        *copy.method_mut() = request.method().clone();
        *copy.uri_mut() = self.uri.clone();
        *copy.version_mut() = request.version();
        *copy.headers_mut() = std::mem::take(request.headers_mut());
        *copy.extensions_mut() = extensions.clone();
        copy.extensions_mut().insert(Claimed);
        Box::pin(async move {
            let failed =
                |e: S::Error| reqwest_middleware::Error::middleware(ServiceError(e.into()));
            let request = copy;
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .map_err(failed)?;
            let response = service.call(request).await.map_err(failed)?;
            // The answer as the layer hands it back, its body boxed once.
            Ok(response.map(reqwest::Body::wrap))
        })
    }

    fn seen<'o>(&'o self, outcome: &'o reqwest_middleware::Result<Self::Reply>) -> Seen<'o> {
        match outcome {
            Ok(response) => Seen::Answer(ResponseHead {
                status: response.status(),
                version: response.version(),
                headers: response.headers(),
                from: &self.uri,
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

impl<T: Beneath + ?Sized> Beneath for Box<T> {
    type Reply = T::Reply;

    fn run<'s>(
        &'s self,
        request: reqwest::Request,
        extensions: &'s mut Extensions,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<T::Reply>> + Send + 's>> {
        (**self).run(request, extensions)
    }

    fn seen<'o>(&'o self, outcome: &'o reqwest_middleware::Result<T::Reply>) -> Seen<'o> {
        (**self).seen(outcome)
    }
}

/// Where a URI points, as the engine reads it: only when a rule asks.
impl Locate for http::Uri {
    fn target(&self) -> Target<'_> {
        Target::new(
            self.scheme_str().unwrap_or(""),
            self.host().unwrap_or(""),
            self.port_u16(),
        )
    }
}

/// An answer of the tower door: its body is read a frame at a time, and replaced in place.
impl Reply for http::Response<reqwest::Body> {
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

    fn chunk(&mut self) -> impl Future<Output = Result<Option<Bytes>, reqwest::Error>> + Send {
        std::future::poll_fn(|cx| {
            // Bounded by what the body has ready: a frame that is not data (trailers) is
            // passed over, and the next one polled at once.
            loop {
                let frame = std::task::ready!(Pin::new(self.body_mut()).poll_frame(cx));
                match frame {
                    None => return Poll::Ready(Ok(None)),
                    Some(Err(e)) => return Poll::Ready(Err(e)),
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            return Poll::Ready(Ok(Some(data)));
                        }
                    }
                }
            }
        })
    }

    fn rebody(self, body: impl FnOnce(reqwest::Body) -> reqwest::Body) -> Self {
        self.map(body)
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
