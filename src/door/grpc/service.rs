//! The service the layer makes: each call handed to the driver under its method's dependency,
//! its copies to the transport, and a call that ends in a failure status handed back as the
//! `tonic::Status` it stands for, with its record.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tower_service::Service;

use super::call::Call;
use super::inner::{Answer, GrpcBody, Inner, Shared};
use crate::driver::claim::{self, Beneath, Claimed};
use crate::driver::middleware::RetryMiddleware;
use crate::driver::retry_body::RetryBody;
use crate::driver::send_body::SendBody;
use crate::engine::dependency::RetryOverride;
use crate::engine::grpc;
use crate::error::{BoxError, LastError, RetryError};
use crate::record::RetryRecord;
use crate::stop::StopReason;

/// A tower [`Service`] of gRPC calls that retries them as gRFC A6 says, made by
/// [`GrpcRetryLayer`](crate::grpc::GrpcRetryLayer) around a gRPC transport (feature `grpc`).
///
/// It takes tonic's `http::Request<tonic::body::Body>`, as a generated client sends it, and
/// hands each attempt to the transport as the same: a tonic `Channel`, or any service of
/// `http::Request<tonic::body::Body>` answering with an `http::Response` whose body's data is
/// [`Bytes`]. So a generated client takes it in place of its channel:
/// `EchoClient::new(ServiceBuilder::new().layer(layer).service(channel))`.
///
/// A call that ends with a gRPC status other than `OK` in its head (a trailers-only answer), or
/// with an HTTP failure that has none (a proxy's `503`), is handed back as an error: the
/// `tonic::Status` that tonic would have read from it, whose source carries the
/// [`RetryRecord`] ([`RetryRecord::of_status`] reads it). A committed
/// call's answer carries its record in its extensions (`RetryRecord::of` on the
/// `tonic::Response`). A transport failure the layer gave up on is a
/// [`RetryError<BoxError>`](crate::RetryError), boxed, which tonic makes a `Status` of by its
/// causes (a refused connection is `UNAVAILABLE`), keeping it as that status's source.
///
/// `poll_ready` is always ready: each attempt waits for its own clone of the transport to be
/// ready.
#[derive(Debug, Clone)]
pub struct GrpcRetryService<S> {
    pub(super) retry: Arc<RetryMiddleware>,
    /// Shared by the clones of this service and the calls in flight: each attempt calls a clone
    /// of the transport of its own.
    pub(super) shared: Arc<Shared<S>>,
}

impl<S, R> Service<http::Request<tonic::body::Body>> for GrpcRetryService<S>
where
    S: Service<http::Request<tonic::body::Body>, Response = http::Response<R>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    R: http_body::Body<Data = Bytes> + Unpin + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Response = http::Response<RetryBody<GrpcBody<R>>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        let mut extensions = std::mem::take(&mut parts.extensions);
        // The call's deadline spans every attempt, as A6 says: its method's timeout or a
        // request's own override may shorten it, never drop it, nor pass A6's cap on attempts.
        let told = grpc::timeout_of(&parts.headers);
        let calls = &self.shared.channel.calls;
        let timeout = calls.deadline(parts.uri.path(), told);
        let asked = extensions.get::<RetryOverride>().copied();
        if timeout.is_some() || asked.is_some() {
            let over = calls.overriding(parts.uri.path(), timeout, asked.unwrap_or_default());
            // The server is told the deadline the call keeps: a shorter one of its method's or
            // of an override too.
            if let Some(deadline) = over.deadline_set().filter(|d| Some(*d) != told) {
                (parts.headers).insert(grpc::GRPC_TIMEOUT, grpc::timeout_value(deadline));
            }
            extensions.insert(over);
        }
        let body = SendBody::new(body);
        let held = self.shared.channel.buffer.hold(&body);
        let call = Call {
            request: http::Request::from_parts(parts, body),
            held,
        };
        let inner = Inner {
            shared: self.shared.clone(),
        };
        if extensions.get::<Claimed>().is_some() || claim::claimed(&extensions, &call) {
            // A layer further out on this call's path makes its attempts.
            return Box::pin(async move { inner.run(call, &mut extensions).await });
        }
        #[cfg(feature = "metrics")]
        let report = Some(self.shared.reporter(call.request.uri().path()));
        #[cfg(not(feature = "metrics"))]
        let report = ();
        let run = RetryMiddleware::execute(self.retry.clone(), call, extensions, inner);
        // The call's future, written into its box as it is made; an `async` block around it
        // would hold it twice (as the block's capture and as what it awaits).
        let place = Box::new_uninit();
        let answered: Box<Answered<_>> = Box::write(place, Answered { run, report });
        Box::into_pin(answered)
    }
}

/// What a call reports to gRPC's metrics when it ends (gRFC A96; nothing without the
/// `metrics` feature).
#[cfg(not(feature = "metrics"))]
type Report = ();

/// What a call reports to gRPC's metrics when it ends (gRFC A96): its method's reporter, one
/// per method and channel, made once (so a call holds one pointer more, and allocates nothing).
#[cfg(feature = "metrics")]
type Report = Option<Arc<super::metrics::Reporter>>;

/// The record of a call that ended in `answer`, if it has one.
#[cfg(feature = "metrics")]
fn record_of<R>(answer: &Result<Answer<R>, BoxError>) -> Option<RetryRecord> {
    match answer {
        Ok(answer) => RetryRecord::of(answer),
        Err(e) => (e.downcast_ref::<tonic::Status>())
            .and_then(RetryRecord::of_status)
            .or_else(|| {
                e.downcast_ref::<RetryError<BoxError>>()
                    .map(RetryError::record)
            }),
    }
}

pin_project_lite::pin_project! {
    /// A call's future: the driver's, its answer handed back as [`failed_status`] says (and
    /// reported to gRPC's metrics, with the feature).
    struct Answered<F> {
        #[pin]
        run: F,
        report: Report,
    }
}

impl<F, R> Future for Answered<F>
where
    F: Future<Output = Result<Answer<R>, BoxError>>,
{
    type Output = Result<Answer<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = std::task::ready!(this.run.poll(cx));
        let answer = answer.map_err(past_deadline).and_then(failed_status);
        #[cfg(feature = "metrics")]
        if let Some(reporter) = this.report.take() {
            reporter.call_ended(record_of(&answer).as_ref());
        }
        #[cfg(not(feature = "metrics"))]
        let _ = this.report;
        Poll::Ready(answer)
    }
}

/// A call whose deadline passed ends `DEADLINE_EXCEEDED`, as a gRPC client's call past its
/// deadline does, whichever timer cut it: the layer's (a gRPC call has no attempt timeout of
/// its own, so the layer's timer is the deadline's), tonic's channel's, at the `grpc-timeout`
/// the attempt carried (tonic's own error would say `CANCELLED`), or the wait before a retry
/// that the deadline cut. The layer's error, with its record, is the status's source. Any
/// other error goes as it is, for tonic to read.
fn past_deadline(err: BoxError) -> BoxError {
    let timed_out = err.downcast_ref::<RetryError<BoxError>>().is_some_and(|e| {
        matches!(e.last_error(), LastError::TimedOut(_))
            || e.stop_reason() == StopReason::DeadlineReached
    });
    if !timed_out {
        return err;
    }
    let mut status = tonic::Status::deadline_exceeded(err.to_string());
    status.set_source(Arc::from(err));
    Box::new(status)
}

/// A call's answer as the caller gets it: a trailers-only answer with a failure status is the
/// `tonic::Status` it says, its source the call's record; so is an HTTP failure without a
/// gRPC status (a proxy's `503`), as the code gRPC maps its HTTP status to, with the message
/// tonic gives it; a failure the call's deadline ended (the wait before a retry cut at the
/// deadline, or a `CANCELLED` that came at it) is `DEADLINE_EXCEEDED`; any other answer as it
/// came.
fn failed_status<R>(answer: Answer<R>) -> Result<Answer<R>, BoxError> {
    let code = match grpc::said(answer.status(), answer.headers()) {
        grpc::Said::Status(code) if code != grpc::OK => code,
        _ => return Ok(answer),
    };
    let record = answer.extensions().get::<RetryRecord>();
    let mut status = if record.is_some_and(|r| r.stop == StopReason::DeadlineReached) {
        tonic::Status::deadline_exceeded(format!(
            "the call's deadline passed; its last attempt ended {}",
            grpc::NAMES[usize::from(code)]
        ))
    } else {
        tonic::Status::from_header_map(answer.headers()).unwrap_or_else(|| {
            tonic::Status::new(
                tonic::Code::from(i32::from(code)),
                format!(
                    "grpc-status header missing, mapped from HTTP status code {}",
                    answer.status().as_u16()
                ),
            )
        })
    };
    // Every failure the layer hands back carries its record (only a first-attempt success is
    // spared one); without it the answer goes as it came, for tonic to read.
    let Some(record) = answer.extensions().get::<RetryRecord>().cloned() else {
        return Ok(answer);
    };
    status.set_source(Arc::new(Ended(record)));
    Err(Box::new(status))
}

/// The source of a `tonic::Status` the layer handed back: the call's record.
#[derive(Debug)]
struct Ended(RetryRecord);

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let record = &self.0;
        write!(
            f,
            "the call ended after {} attempt(s): {}",
            record.attempts, record.stop
        )
    }
}

impl std::error::Error for Ended {}

/// A tonic answer through the gRPC door: tonic keeps the `http::Response`'s extensions, and
/// with them the record; a failure is tonic's `Err`, never a `Response`.
impl<T> crate::record::Answer for tonic::Response<T> {
    fn parts(&self) -> (bool, &http::Extensions) {
        (false, self.extensions())
    }

    /// A call answered at its first attempt: the server committed to it (a trailers-only
    /// `OK` through the layer carries its record).
    fn bare(&self) -> StopReason {
        StopReason::Committed
    }
}

impl<T> crate::record::sealed::Sealed for tonic::Response<T> {}

impl RetryRecord {
    /// The record of the call that ended in `status` through a
    /// [`GrpcRetryLayer`](crate::grpc::GrpcRetryLayer) (feature `grpc`): a failure status the
    /// server answered with, or a transport failure the layer gave up on. `None` for a status
    /// that did not come from the layer.
    pub fn of_status(status: &tonic::Status) -> Option<RetryRecord> {
        let source = std::error::Error::source(status)?;
        if let Some(ended) = source.downcast_ref::<Ended>() {
            return Some(ended.0.clone());
        }
        // tonic keeps the error it read the status from as the status's source.
        let gave_up = source.downcast_ref::<RetryError<BoxError>>()?;
        Some(gave_up.record())
    }
}
