//! The service: one request's way through the layer, phase by phase — admission (key, scope,
//! body), the claim, running and completing, and the answers the layer gives itself (replays
//! among them).

mod admission;
mod answers;
mod claim;
mod running;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::body::{BoxError, ReplyBody};
use crate::config::Config;
use crate::store::Store;

use admission::{Admission, admit};
use claim::{Claiming, claim};
pub(crate) use claim::{Held, Owned};
pub(crate) use running::{Ended, end_failed, execute};

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

/// The future of an [`Idempotent`] service.
pub type IdempotentFuture<R, E> =
    Pin<Box<dyn Future<Output = Result<Response<ReplyBody<R>>, E>> + Send>>;

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
        // The service polled ready goes with this request; a clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        if !config.methods.contains(request.method())
            || request.extensions().get::<Resumed>().is_some()
        {
            return Box::pin(pass(inner, request));
        }
        Box::pin(run(config, inner, request))
    }
}

async fn pass<Svc, B, R>(
    mut inner: Svc,
    request: Request<B>,
) -> Result<Response<ReplyBody<R>>, Svc::Error>
where
    Svc: Service<Request<B>, Response = Response<R>>,
{
    Ok(inner
        .call(request)
        .await?
        .map(|body| ReplyBody::inner(Bytes::new(), body)))
}

async fn run<Svc, S, B, R>(
    config: Arc<Config<S>>,
    inner: Svc,
    request: Request<B>,
) -> Result<Response<ReplyBody<R>>, Svc::Error>
where
    Svc: Service<Request<B>, Response = Response<R>>,
    S: Store,
    B: Body + From<Bytes>,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let admitted = match admit(&config, request).await {
        Admission::Admitted(admitted) => admitted,
        Admission::Pass(request) => return pass(inner, request).await,
        Admission::Refused(answer) => return Ok(answer),
    };
    let owned = match claim(&config, &admitted).await {
        Claiming::Owned(owned) => owned,
        Claiming::Answered(answer) => return Ok(answer),
    };
    execute(&config, inner, admitted.parts, admitted.body, owned)
        .await
        .map(|(answer, _)| answer)
}

/// The marker of a request the reconciler resumes: the layer, if the reconciler's service
/// has it too, passes the request straight to the handler.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resumed;
