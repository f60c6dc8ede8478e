//! The service the layer makes: each request handed to the driver, its copies to the inner
//! service.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tower_service::Service;

use super::error::BoxError;
use super::inner::Inner;
use crate::driver::claim::{Beneath, Claimed};
use crate::driver::middleware::RetryMiddleware;
use crate::driver::retry_body::RetryBody;
use crate::driver::send_body::SendBody;

/// A tower [`Service`] that retries what is safe to repeat, made by [`RetryMiddleware`] as a
/// [`Layer`](tower_layer::Layer) (feature `tower`).
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
/// [`RetryError<BoxError>`](crate::RetryError) when the layer made the attempts
/// ([`RetryError::of_boxed`](crate::RetryError::of_boxed) finds it), its last error the inner
/// service's own, boxed, or the layer's; else (the request passed through to a layer further
/// out) the inner service's error as it was.
///
/// ```
/// use reqwest_safe_retry::{RetryMiddleware, RetryPolicy};
/// use tower_layer::Layer;
///
/// let connector = hyper_util::client::legacy::connect::HttpConnector::new();
/// let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
///     .build::<_, reqwest_safe_retry::body::SendBody<String>>(connector);
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
    pub(super) retry: Arc<RetryMiddleware>,
    /// Shared by the clones of this service and the requests in flight: each attempt calls a
    /// clone of its own.
    pub(super) inner: Arc<S>,
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
    R: http_body::Body + Unpin + Send + 'static,
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
        let mut extensions = std::mem::take(&mut parts.extensions);
        let inner = Inner::new(self.inner.clone());
        let request = http::Request::from_parts(parts, SendBody::new(body));
        let claimed = extensions.get::<Claimed>().is_some()
            || crate::driver::claim::claimed(&extensions, &request);
        if claimed {
            // A layer further out on this request's path makes its attempts (the gRPC door's,
            // whose calls may carry a path alone, among them).
            return Box::pin(async move { inner.run(request, &mut extensions).await });
        }
        if let Err(e) = absolute(request.uri()) {
            return Box::pin(std::future::ready(Err(e)));
        }
        // The future owns the middleware, the extensions and a handle on the inner service: it
        // is one allocation in the allocator's fast size class, written into its place as it is
        // made (not made beside it and copied there).
        let place = Box::new_uninit();
        let run = RetryMiddleware::execute(self.retry.clone(), request, extensions, inner);
        let run: Box<_> = Box::write(place, run);
        Box::into_pin(run)
    }
}

/// Whether the layer can send a request to `uri`: one with a scheme and a host, as a client
/// needs; else the error that says so.
pub(super) fn absolute(uri: &http::Uri) -> Result<(), BoxError> {
    if uri.scheme().is_some() && uri.authority().is_some() {
        return Ok(());
    }
    Err(format!(
        "the retry layer needs an absolute URI, with a scheme and a host (http://host/path), \
         as a client does; got {uri:?}"
    )
    .into())
}
