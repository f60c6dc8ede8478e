//! The HTTP front: the tower service over a handler, guarding the configured methods, and
//! HTTP's words for the engine — RFC 9457 problems for the layer's own answers, the status,
//! end-to-end headers and body as the stored outcome, `Idempotent-Replayed: true` on a replay.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::response::Parts as Head;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Body;
use tower_service::Service;

use crate::body::{BoxError, ReplyBody, Whole};
use crate::config::Config;
use crate::engine::{Asked, IdempotentFuture, Resumed, pass, run, take_ready};
use crate::headers::{IDEMPOTENT_REPLAYED, end_to_end};
use crate::problem::{Problem, retry_hint};
use crate::store::{Store, StoredAnswer};
use crate::transport::{Front, Mark};

/// HTTP's words: problems, and the statuses a layer is told not to store.
#[derive(Debug, Clone, Default)]
pub(crate) struct Http {
    pub(crate) not_stored: Vec<StatusCode>,
}

impl Front for Http {
    fn own(
        &self,
        problem: Problem,
        detail: &str,
        retry_after: Option<Duration>,
    ) -> Response<Bytes> {
        let mut response = problem.response(detail);
        if let Some(after) = retry_after {
            retry_hint(&mut response, after);
        }
        response
    }

    fn mark(&self, head: &mut Head) -> Option<Mark> {
        crate::transport::not_stored(&self.not_stored, head)
    }

    fn stored(&self, head: &Head, body: Option<&Bytes>, _: Option<&HeaderMap>) -> StoredAnswer {
        StoredAnswer {
            status: head.status,
            headers: end_to_end(&head.headers),
            body: body.cloned(),
        }
    }

    /// Under the shared scope a replay may go to another caller than the first, so it never
    /// carries the first caller's `Set-Cookie`.
    fn replay(&self, stored: &StoredAnswer, shared_scope: bool) -> Response<Whole> {
        let mut response = match &stored.body {
            Some(body) => {
                let mut response = Response::new(body.clone());
                let headers = response.headers_mut();
                for (name, value) in &stored.headers {
                    if shared_scope && name == header::SET_COOKIE {
                        continue;
                    }
                    headers.append(name.clone(), value.clone());
                }
                response
            }
            None => Problem::AnswerNotStored.response_with_status(
                stored.status,
                "this request completed before; its answer was too large to store, so only its status is replayed",
            ),
        };
        *response.status_mut() = stored.status;
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response.map(|data| Whole {
            data,
            trailers: None,
        })
    }
}

/// The service the [`IdempotencyLayer`](crate::layer::IdempotencyLayer) makes.
pub struct Idempotent<Svc, S> {
    pub(crate) inner: Svc,
    pub(crate) config: Arc<Config<S>>,
}

impl<Svc: Clone, S> Clone for Idempotent<Svc, S> {
    fn clone(&self) -> Self {
        Idempotent {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<Svc: std::fmt::Debug, S> std::fmt::Debug for Idempotent<Svc, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotent")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<Svc, S, B, R> Service<Request<B>> for Idempotent<Svc, S>
where
    Svc: Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    Svc::Future: Send,
    Svc::Error: Send,
    S: Store,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Unpin + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Response = Response<ReplyBody<R>>;
    type Error = Svc::Error;
    type Future = IdempotentFuture<R, Svc::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let inner = take_ready(&mut self.inner);
        let config = self.config.clone();
        if !config.methods.contains(request.method())
            || request.extensions().get::<Resumed>().is_some()
        {
            return Box::pin(pass(inner, request));
        }
        let asked = Asked {
            rebody: B::from,
            key_required: config.require_key,
        };
        Box::pin(async move { run(&config, inner, request, asked).await })
    }
}
