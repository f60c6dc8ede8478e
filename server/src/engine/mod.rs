//! The engine: one unit of work's way from its key to its outcome, whatever transport brought
//! it — admission (key, scope, body), the atomic claim and its hold, running the handler under
//! the claim, and settling its answer (stored with its local effects, or not an outcome, or
//! rejected, or fenced). A front (`transport::Front`) says how its transport answers: the layer's own
//! answers, what of a handler's answer is stored, and how a stored one is sent again.

mod admission;
mod answers;
mod claim;
mod running;

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

/// A guarded request's way: admitted, claimed, run. A request admission finds unguarded (no
/// key where none is required) goes to the handler as it is.
pub(crate) async fn run<Svc, S, B, R>(
    config: &Config<S>,
    inner: Svc,
    request: Request<B>,
    asked: Asked<B>,
) -> Result<Response<ReplyBody<R>>, Svc::Error>
where
    Svc: Service<Request<B>, Response = Response<R>>,
    S: Store,
    B: Body,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    run_to_end(config, inner, request, asked)
        .await
        .map(|(answer, _)| answer)
}

/// [`run`], and what became of the execution when this request ran the handler under a
/// claim (`None` when it was refused, passed, or answered from the record).
pub(crate) async fn run_to_end<Svc, S, B, R>(
    config: &Config<S>,
    inner: Svc,
    request: Request<B>,
    asked: Asked<B>,
) -> Result<(Response<ReplyBody<R>>, Option<Ended>), Svc::Error>
where
    Svc: Service<Request<B>, Response = Response<R>>,
    S: Store,
    B: Body,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let admitted = match admit(config, request, asked).await {
        Admission::Admitted(admitted) => admitted,
        Admission::Pass(request) => return Ok((pass(inner, request).await?, None)),
        Admission::Refused(answer) => return Ok((answer, None)),
    };
    let owned = match claim(config, &admitted).await {
        Claiming::Owned(owned) => owned,
        Claiming::Answered(answer) => return Ok((answer, None)),
    };
    execute(
        config,
        inner,
        admitted.parts,
        admitted.body,
        asked.rebody,
        owned,
    )
    .await
    .map(|(answer, ended)| (answer, Some(ended)))
}

/// What a front asks of the engine for a request: the handler's body rebuilt from the bytes
/// the engine read, and whether the request must carry a key.
pub(crate) struct Asked<B> {
    pub(crate) rebody: fn(Bytes) -> B,
    pub(crate) key_required: bool,
}

impl<B> Clone for Asked<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Asked<B> {}

/// A request the layer does not guard: to the handler, nothing recorded.
pub(crate) async fn pass<Svc, B, R>(
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

/// The future of a front's service: the layer's answer, or the handler's error.
pub type IdempotentFuture<R, E> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response<ReplyBody<R>>, E>> + Send>>;

/// The handler a front's service calls for this request: the one polled ready goes with the
/// request, and a clone stays for the next (tower's readiness contract).
pub(crate) fn take_ready<Svc: Clone>(inner: &mut Svc) -> Svc {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// The marker of a request the reconciler resumes: the layer, if the reconciler's service
/// has it too, passes the request straight to the handler.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resumed;
