//! This door's side of the driver: where each copy of a call goes (the inner gRPC transport,
//! `Beneath`), how its errors are read, and the body of its answer, whose trailers' status the
//! channel's throttling counts.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Extensions;
use http_body::{Body, Frame, SizeHint};
use tower_service::Service;

use super::call::{Buffer, Call};
#[cfg(feature = "metrics")]
use super::metrics::Reporter;
use crate::driver::beneath_service;
use crate::driver::claim::{Beneath, Claimed};
use crate::driver::retry_body::RetryBody;
use crate::engine::grpc::config::{Calls, GrpcConfig};
use crate::engine::grpc::throttle::RetryThrottling;
use crate::engine::grpc::{self, CodeSet, Said};
use crate::engine::seen::{Failure, Locate, ResponseHead};
use crate::error::BoxError;
use crate::fault::{self, Fault};

/// What counts a committed call's status when its trailers come: the channel's throttling,
/// and the codes the call's policy retries.
#[derive(Debug, Clone)]
pub(super) struct Count {
    pub(super) throttling: RetryThrottling,
    pub(super) codes: CodeSet,
    /// The channel's target, for the tokens' gauge.
    #[cfg(feature = "metrics")]
    pub(super) target: Arc<str>,
}

/// The transport beneath, as the driver sends copies to it: each copy to a clone of its own.
pub(super) struct Inner<S> {
    pub(super) shared: Arc<Shared<S>>,
}

/// An answer of this door: the transport's, its body passed on in a [`GrpcBody`].
pub(super) type Answer<R> = http::Response<RetryBody<GrpcBody<R>>>;

/// A copy on its way (boxed: it waits for the transport to be ready, then for its answer).
pub(super) type Running<'s, R> =
    Pin<Box<dyn Future<Output = Result<Answer<R>, BoxError>> + Send + 's>>;

impl<S, R> Beneath for Inner<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<R>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Unpin + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Request = Call;
    type Reply = Answer<R>;
    /// The transport's error, boxed as tower passes errors.
    type Error = BoxError;

    type Running<'s>
        = Running<'s, R>
    where
        Self: 's;

    fn run<'s>(&'s self, call: Call, extensions: &'s mut Extensions) -> Running<'s, R> {
        self.send(S::clone(&self.shared.service), call, extensions)
    }

    /// A clone of the transport, asked with the call's own waker until it is ready.
    type Ready = S;

    fn poll_ready(&self, ready: &mut Option<S>, cx: &mut Context<'_>) -> Poll<bool> {
        beneath_service::poll_clone_ready::<S, _>(&self.shared.service, ready, cx)
    }

    fn run_ready<'s>(
        &'s self,
        ready: S,
        call: Call,
        extensions: &'s mut Extensions,
    ) -> Running<'s, R> {
        self.send(ready, call, extensions)
    }

    /// An answer came from where its call went (`to`).
    fn head<'o>(&'o self, reply: &'o Answer<R>, to: &'o dyn Locate) -> ResponseHead<'o> {
        ResponseHead {
            status: reply.status(),
            version: reply.version(),
            headers: reply.headers(),
            from: to,
        }
    }

    /// The transport's error, judged by its causes: tonic's own (a connection it could not
    /// make sent nothing; its deadline timer is a timeout), else those behind any client's (a
    /// reset or a stream cut short may have reached the server).
    fn failure<'o>(&'o self, err: &'o BoxError) -> Failure<'o> {
        let err: &(dyn std::error::Error + 'static) = &**err;
        Failure {
            fault: tonic_fault(err).or_else(|| fault::of_causes(err)),
            error: err,
        }
    }

    /// A call answered at its first attempt is committed: its status follows in its
    /// trailers, and it carries no record (a trailers-only `OK` does).
    fn answered(&self) -> crate::stop::StopReason {
        crate::stop::StopReason::Committed
    }
}

/// The fault tonic's transport names in `err`'s chain: `ConnectError` (nothing sent) or
/// `TimeoutExpired` (the call's `grpc-timeout` ran out).
fn tonic_fault(err: &(dyn std::error::Error + 'static)) -> Option<Fault> {
    let mut source = Some(err);
    // Bounded, as every walk of a chain here.
    for _ in 0..64 {
        let at = source?;
        if at.is::<tonic::ConnectError>() {
            return Some(Fault::Connect);
        }
        if at.is::<tonic::TimeoutExpired>() {
            return Some(Fault::Timeout);
        }
        source = at.source();
    }
    None
}

/// The transport, and what every call through the layer shares.
#[derive(Debug)]
pub(crate) struct Shared<S> {
    pub(super) service: S,
    pub(super) channel: Arc<Channel>,
    /// This channel's throttling count, if the config has throttling.
    pub(super) throttling: Option<RetryThrottling>,
    /// The channel's target, as gRPC's metrics label it (`grpc.target`).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(super) target: Arc<str>,
    /// The reporter of each method called through this channel, made at its first call.
    #[cfg(feature = "metrics")]
    pub(super) reporters: std::sync::Mutex<std::collections::HashMap<Box<str>, Arc<Reporter>>>,
}

#[cfg(feature = "metrics")]
impl<S> Shared<S> {
    /// The reporter of the calls to `path` through this channel: made at the method's first
    /// call, then shared (past 1,024 methods, one for all the others, `other`).
    pub(super) fn reporter(&self, path: &str) -> Arc<Reporter> {
        let method = path.strip_prefix('/').unwrap_or(path);
        let mut reporters = self.reporters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(reporter) = reporters.get(method) {
            return reporter.clone();
        }
        let method = super::metrics::label(reporters.len(), method);
        if let Some(other) = reporters.get(method) {
            return other.clone();
        }
        let reporter = Arc::new(Reporter {
            method: method.into(),
            target: self.target.clone(),
            throttling: self.throttling.clone(),
        });
        reporters.insert(method.into(), reporter.clone());
        reporter
    }
}

/// What every call through one layer shares: the config, and the buffer for replays.
#[derive(Debug)]
pub(crate) struct Channel {
    pub(super) config: GrpcConfig,
    /// What each call runs under, by its path.
    pub(super) calls: Calls,

    pub(super) buffer: Buffer,
}

impl<S> Inner<S> {
    /// What counts the call to `path` at its trailers: its channel's throttling, if it has
    /// one, and the codes its policy retries.
    fn count(&self, path: &str) -> Option<Count> {
        let throttling = self.shared.throttling.as_ref()?;
        let policy = self.shared.channel.calls.of(path).policy?;
        Some(Count {
            throttling: throttling.clone(),
            codes: policy.codes(),
            #[cfg(feature = "metrics")]
            target: self.shared.target.clone(),
        })
    }

    /// Sends `call` to `service` once it is ready, marked as claimed; its answer's body passed
    /// on, counted at its trailers when the call was committed.
    fn send<'s, R>(&'s self, mut service: S, call: Call, extensions: &Extensions) -> Running<'s, R>
    where
        S: Service<http::Request<tonic::body::Body>, Response = http::Response<R>> + Send + 's,
        S::Future: Send,
        S::Error: Into<BoxError>,
        R: Body<Data = Bytes> + Unpin + Send + 'static,
    {
        // The hold on the channel's buffer goes with the original, as it is sent.
        let Call { mut request, held } = call;
        drop(held);
        *request.extensions_mut() = extensions.clone();
        request.extensions_mut().insert(Claimed);
        let count = self.count(request.uri().path());
        let request = request.map(|body| tonic::body::Body::new(AsSent(body)));
        Box::pin(async move {
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .map_err(Into::into)?;
            let answer = match service.call(request).await {
                Ok(answer) => answer,
                Err(e) => return status_answer(e.into()),
            };
            // Only a committed call's status comes in its trailers: the engine counted any
            // other's from its head.
            let count =
                count.filter(|_| grpc::said(answer.status(), answer.headers()) == Said::Committed);
            Ok(answer.map(|body| RetryBody::inner(GrpcBody { inner: body, count })))
        })
    }
}

/// A transport's error that is a gRPC status (what an interceptor, or a retry layer beneath
/// this one, answers with) read as the trailers-only answer it stands for, the status in its
/// extensions: its code and pushback are judged as a server's. Any other error as it is.
fn status_answer<R>(err: BoxError) -> Result<Answer<R>, BoxError> {
    let status = err.downcast::<tonic::Status>()?;
    Ok(status
        .into_http::<()>()
        .map(|()| RetryBody::whole(Bytes::new())))
}

/// A copy's body as tonic's encoder would have sent it: the same frames, without an exact size
/// (which would put a `content-length` on the call that tonic never sends).
struct AsSent(super::call::CallBody);

impl Body for AsSent {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = SizeHint::new();
        hint.set_lower(self.0.size_hint().lower());
        hint
    }
}

/// The body of an answer through [`GrpcRetryService`](crate::grpc::GrpcRetryService) (feature
/// `grpc`): the transport's body `B`, passed on frame by frame as it comes. When the call was
/// committed and its channel has [`RetryThrottling`], the `grpc-status` of its trailers is
/// counted there as they pass (`OK` refills the count, a status the method's policy retries
/// spends it), as gRPC's own clients count a call's end.
#[derive(Debug)]
pub struct GrpcBody<B> {
    inner: B,
    count: Option<Count>,
}

impl<B> Body for GrpcBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        let trailers = frame.as_ref().and_then(|f| f.as_ref().ok()?.trailers_ref());
        if let Some(trailers) = trailers {
            // Counted once, at the trailers (the data before them counts nothing).
            let count = self.count.take();
            let status = count
                .as_ref()
                .and_then(|_| grpc::header(trailers, &grpc::GRPC_STATUS));
            if let (Some(status), Some(count)) = (status, count) {
                count.throttling.ended(grpc::code_of(status), count.codes);
                #[cfg(feature = "metrics")]
                super::metrics::tokens(&count.target, &count.throttling);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn an_answer_s_body_passes_through_as_it_comes() {
        let mut body = GrpcBody {
            inner: Full::new(Bytes::from_static(b"abc")),
            count: None,
        };
        assert_eq!(body.size_hint().exact(), Some(3));
        assert!(!body.is_end_stream());
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "abc");
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_copy_s_body_has_its_bytes_and_no_exact_size() {
        let mut sent = AsSent(crate::driver::send_body::SendBody::whole(
            Bytes::from_static(b"abcd"),
        ));
        let hint = sent.size_hint();
        assert_eq!((hint.lower(), hint.upper()), (4, None));
        assert!(!sent.is_end_stream());
        let all = (&mut sent).collect().await.unwrap().to_bytes();
        assert_eq!(all, "abcd");
        assert!(sent.is_end_stream());
    }
}
