//! The gRPC front: a tower service for tonic servers, guarding the methods it is told, and
//! gRPC's words for the engine — the layer's own answers as gRPC statuses (one table,
//! [`code_of`]), the whole answer stored (headers, messages and trailers), a replay marked
//! `idempotent-replayed: true` in its metadata.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::response::Parts as Head;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body::Body;
use sha2::{Digest, Sha256};
use tonic::{Code, Status};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::{BoxError, ReplyBody, Whole};
use crate::config::{Config, Counters};
use crate::engine::{Asked, IdempotentFuture, Resumed, pass, run, take_ready};
use crate::execution::{Execution, LocalError};
use crate::headers::{IDEMPOTENT_REPLAYED, end_to_end};
use crate::markers::Rejected;
use crate::problem::Problem;
use crate::step::StepError;
use crate::store::{Store, StoreError, StoredAnswer, decode_headers, encode_headers};
use crate::transport::{Front, Mark};

/// The metadata a handler's status carries to tell the layer what it is (a step unfinished, a
/// step fenced, a rejection); the layer takes it out before the answer leaves.
const MARK: &str = "safe-retry-mark";

/// The metadata that names the layer's own answer (`in-progress`, `key-reused`, …).
pub const PROBLEM: &str = "safe-retry-problem";

/// gRFC A6's pushback: when the client may try again, in milliseconds; `-1` says never.
const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// The gRPC code of each of the layer's own answers, and whether a client must not retry it
/// (then the answer carries `grpc-retry-pushback-ms: -1`, which an A6 client obeys whatever
/// codes its policy retries). Chosen so that a client that retries A6's usual `UNAVAILABLE`
/// does the right thing: it comes back for a call still in progress, a failed store or an
/// unfinished step (each with a pushback saying when), and never for the rest.
pub fn code_of(problem: Problem) -> (Code, bool) {
    match problem {
        Problem::MissingKey | Problem::MalformedKey => (Code::InvalidArgument, true),
        Problem::BodyUnreadable => (Code::InvalidArgument, true),
        Problem::NoScope => (Code::Unauthenticated, true),
        Problem::BodyTooLarge => (Code::ResourceExhausted, true),
        Problem::BodyTimeout => (Code::DeadlineExceeded, false),
        Problem::KeyReused => (Code::FailedPrecondition, true),
        Problem::InProgress
        | Problem::StoreUnavailable
        | Problem::StepUnfinished
        | Problem::TakenOver => (Code::Unavailable, false),
        Problem::HandlerFailed => (Code::Internal, false),
        Problem::AnswerNotStored => (Code::DataLoss, true),
        Problem::GaveUp => (Code::Aborted, true),
    }
}

/// The status of one of the layer's own answers.
fn status_of(problem: Problem, detail: &str, retry_after: Option<Duration>) -> Status {
    let (code, never) = code_of(problem);
    let mut status = Status::new(code, format!("{}: {detail}", problem.name()));
    let metadata = status.metadata_mut();
    metadata.insert(PROBLEM, problem.name().parse().expect("a problem's name"));
    let pushback = match retry_after {
        Some(after) => Some(
            u64::try_from(after.as_millis())
                .unwrap_or(u64::MAX)
                .to_string(),
        ),
        None if never => Some("-1".to_owned()),
        None => None,
    };
    if let Some(pushback) = pushback {
        metadata.insert(PUSHBACK, pushback.parse().expect("digits"));
    }
    status
}

/// gRPC's words: statuses, and the codes of trailers-only answers a layer is told not to
/// store.
#[derive(Debug, Clone, Default)]
pub(crate) struct Grpc {
    pub(crate) not_stored: Vec<Code>,
}

impl Front for Grpc {
    fn own(
        &self,
        problem: Problem,
        detail: &str,
        retry_after: Option<Duration>,
    ) -> Response<Bytes> {
        status_of(problem, detail, retry_after).into_http()
    }

    /// A gRPC call's fingerprint is its path and messages, kept apart from any HTTP request's:
    /// a key sent once over each names two requests, never one.
    fn fingerprint(&self, of_request: [u8; 32]) -> [u8; 32] {
        let mut hash = Sha256::new();
        hash.update(b"safe-retry grpc\0");
        hash.update(of_request);
        hash.finalize().into()
    }

    fn mark(&self, head: &mut Head) -> Option<Mark> {
        if let Some(mark) = head.headers.remove(MARK) {
            return match mark.as_bytes() {
                b"fenced" => Some(Mark::Fenced),
                b"rejected" => Some(Mark::Rejected),
                _ => Some(Mark::Unfinished),
            };
        }
        let code = head
            .headers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok()?.parse::<i32>().ok())
            .map(Code::from_i32)?;
        self.not_stored.contains(&code).then_some(Mark::Unfinished)
    }

    fn stored(
        &self,
        head: &Head,
        body: Option<&Bytes>,
        trailers: Option<&HeaderMap>,
    ) -> StoredAnswer {
        StoredAnswer {
            status: head.status,
            headers: end_to_end(&head.headers),
            body: body.map(|data| encode_answer(data, trailers)),
        }
    }

    fn replay(&self, stored: &StoredAnswer, _shared_scope: bool) -> Response<Whole> {
        let decoded = stored.body.as_ref().map(decode_answer);
        let (data, trailers) = match decoded {
            Some(Ok(decoded)) => decoded,
            None => {
                let detail = "this call completed before; its answer was too large to store";
                return replay_of_own(status_of(Problem::AnswerNotStored, detail, None));
            }
            Some(Err(_)) => {
                let status = Status::internal("a stored answer does not decode");
                return replay_of_own(status);
            }
        };
        let mut response = Response::new(Whole { data, trailers });
        *response.status_mut() = stored.status;
        let headers = response.headers_mut();
        for (name, value) in &stored.headers {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

/// One of the layer's own statuses as a replay.
fn replay_of_own(status: Status) -> Response<Whole> {
    let mut response: Response<Bytes> = status.into_http();
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response.map(|data| Whole {
        data,
        trailers: None,
    })
}

/// A gRPC answer's body as it is stored: the messages' length (8 bytes, big-endian), the
/// messages as they were framed, then the trailers' length (8 bytes; all ones when the answer
/// had no trailers) and the trailers in the stores' header encoding. Every length is checked on
/// reading, so a cut row never reads as a shorter answer.
fn encode_answer(data: &Bytes, trailers: Option<&HeaderMap>) -> Bytes {
    let encoded = trailers.map(|t| {
        let pairs: Vec<(HeaderName, HeaderValue)> =
            t.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        encode_headers(&pairs)
    });
    let trailers_len = encoded.as_ref().map_or(0, Vec::len);
    let mut out = BytesMut::with_capacity(16 + data.len() + trailers_len);
    out.extend_from_slice(&(data.len() as u64).to_be_bytes());
    out.extend_from_slice(data);
    let none = u64::MAX;
    out.extend_from_slice(
        &encoded
            .as_ref()
            .map_or(none, |e| e.len() as u64)
            .to_be_bytes(),
    );
    out.extend_from_slice(encoded.as_deref().unwrap_or_default());
    out.freeze()
}

/// Reads what [`encode_answer`] wrote; a row that does not decode is an error, never a panic.
fn decode_answer(stored: &Bytes) -> Result<(Bytes, Option<HeaderMap>), StoreError> {
    let bad = || StoreError::new("a stored gRPC answer does not decode");
    let read_len = |at: usize| -> Result<u64, StoreError> {
        let bytes = stored
            .get(at..at.checked_add(8).ok_or_else(bad)?)
            .ok_or_else(bad)?;
        Ok(u64::from_be_bytes(bytes.try_into().map_err(|_| bad())?))
    };
    let data_len = usize::try_from(read_len(0)?).map_err(|_| bad())?;
    let data_end = 8usize.checked_add(data_len).ok_or_else(bad)?;
    let data = stored.get(8..data_end).ok_or_else(bad)?;
    let data = stored.slice_ref(data);
    let trailers_len = read_len(data_end)?;
    let trailers_at = data_end + 8;
    if trailers_len == u64::MAX {
        return if stored.len() == trailers_at {
            Ok((data, None))
        } else {
            Err(bad())
        };
    }
    let trailers_len = usize::try_from(trailers_len).map_err(|_| bad())?;
    if stored.len() != trailers_at.checked_add(trailers_len).ok_or_else(bad)? {
        return Err(bad());
    }
    let mut map = HeaderMap::new();
    for (name, value) in decode_headers(&stored[trailers_at..])? {
        map.append(name, value);
    }
    Ok((data, Some(map)))
}

/// A guarded method: its path, and whether its calls must carry a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GuardedMethod {
    pub(crate) path: String,
    pub(crate) key_required: bool,
}

/// A layer for a tonic server: each guarded method's call runs once per (scope, key), its
/// whole answer stored and replayed. Made by
/// [`Builder::build_grpc`](crate::Builder::build_grpc); cheap to clone.
///
/// The handler finds its [`Execution`] in the request's extensions
/// ([`Execution::of_grpc`]); a step's error, a `Local` that fails and a refusal
/// ([`Rejected::grpc`]) become statuses the layer knows not to store.
pub struct GrpcIdempotencyLayer<S> {
    pub(crate) config: Arc<Config<S>>,
    pub(crate) methods: Arc<[GuardedMethod]>,
}

impl<S> Clone for GrpcIdempotencyLayer<S> {
    fn clone(&self) -> Self {
        GrpcIdempotencyLayer {
            config: self.config.clone(),
            methods: self.methods.clone(),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for GrpcIdempotencyLayer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcIdempotencyLayer")
            .field("store", &self.config.store)
            .field("methods", &self.methods)
            .field("lease", &self.config.lease)
            .field("retention", &self.config.retention)
            .field("saved_headers", &self.config.saved_headers)
            .finish_non_exhaustive()
    }
}

impl<S: Store> GrpcIdempotencyLayer<S> {
    /// The layer's counters, shared by every clone of it and of its services.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.config.counters
    }

    /// The store the layer keeps its outcomes in.
    pub fn store(&self) -> &S {
        &self.config.store
    }
}

impl<S, Svc> Layer<Svc> for GrpcIdempotencyLayer<S> {
    type Service = GrpcIdempotent<Svc, S>;

    fn layer(&self, inner: Svc) -> GrpcIdempotent<Svc, S> {
        GrpcIdempotent {
            inner,
            config: self.config.clone(),
            methods: self.methods.clone(),
        }
    }
}

/// The service the [`GrpcIdempotencyLayer`] makes.
pub struct GrpcIdempotent<Svc, S> {
    inner: Svc,
    config: Arc<Config<S>>,
    methods: Arc<[GuardedMethod]>,
}

impl<Svc: Clone, S> Clone for GrpcIdempotent<Svc, S> {
    fn clone(&self) -> Self {
        GrpcIdempotent {
            inner: self.inner.clone(),
            config: self.config.clone(),
            methods: self.methods.clone(),
        }
    }
}

impl<Svc: std::fmt::Debug, S> std::fmt::Debug for GrpcIdempotent<Svc, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcIdempotent")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// A tonic body of whole bytes: what the handler reads once the layer has read the call's.
fn tonic_body(bytes: Bytes) -> tonic::body::Body {
    tonic::body::Body::new(http_body_util::Full::new(bytes))
}

impl<Svc, S, R> Service<Request<tonic::body::Body>> for GrpcIdempotent<Svc, S>
where
    Svc: Service<Request<tonic::body::Body>, Response = Response<R>> + Clone + Send + 'static,
    Svc::Future: Send,
    Svc::Error: Send,
    S: Store,
    R: Body<Data = Bytes> + Unpin + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Response = Response<ReplyBody<R>>;
    type Error = Svc::Error;
    type Future = IdempotentFuture<R, Svc::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<tonic::body::Body>) -> Self::Future {
        let inner = take_ready(&mut self.inner);
        let guarded = self
            .methods
            .iter()
            .find(|method| method.path == request.uri().path());
        let guarded = match guarded {
            Some(method) if request.extensions().get::<Resumed>().is_none() => method,
            _ => return Box::pin(pass(inner, request)),
        };
        let asked = Asked {
            rebody: tonic_body,
            key_required: guarded.key_required,
        };
        let config = self.config.clone();
        Box::pin(async move { run(&config, inner, request, asked).await })
    }
}

/// A status that carries `mark` for the layer.
fn marked(mut status: Status, mark: &'static str) -> Status {
    status
        .metadata_mut()
        .insert(MARK, tonic::metadata::MetadataValue::from_static(mark));
    status
}

impl From<StepError> for Status {
    /// The status for a call that stopped at this error, which the layer does not store: when
    /// another attempt holds the record, the layer answers what happened to it instead (its
    /// stored answer once completed, else `UNAVAILABLE` `in-progress`); when the store failed,
    /// `UNAVAILABLE` `store-unavailable`; else `UNAVAILABLE` `step-unfinished`; each with a
    /// pushback of one second. No error's inner text reaches the caller.
    fn from(error: StepError) -> Status {
        let second = Some(Duration::from_secs(1));
        match &error {
            StepError::Fenced => marked(
                status_of(
                    Problem::InProgress,
                    "another attempt holds this call",
                    second,
                ),
                "fenced",
            ),
            StepError::Store(_) => marked(
                status_of(
                    Problem::StoreUnavailable,
                    crate::problem::STORE_UNAVAILABLE,
                    second,
                ),
                "unfinished",
            ),
            _ => {
                let detail = format!(
                    "{}; the call is kept at its last recovery point; retry with the same key",
                    error.public_reason()
                );
                marked(
                    status_of(Problem::StepUnfinished, &detail, second),
                    "unfinished",
                )
            }
        }
    }
}

impl From<LocalError> for Status {
    /// The status for a call whose handler could not get its transaction, which the layer does
    /// not store: `UNAVAILABLE` `store-unavailable` with a pushback of one second when the
    /// store failed, `INTERNAL` `handler-failed` for a misuse of the layer.
    fn from(error: LocalError) -> Status {
        let status = match &error {
            LocalError::Store(_) => status_of(
                Problem::StoreUnavailable,
                crate::problem::STORE_UNAVAILABLE,
                Some(Duration::from_secs(1)),
            ),
            _ => status_of(Problem::HandlerFailed, &error.to_string(), None),
        };
        marked(status, "unfinished")
    }
}

impl From<StoreError> for Status {
    /// The status for a call whose handler met this error in its `Local` transaction, which
    /// the layer does not store: `UNAVAILABLE` `store-unavailable` with a pushback of one
    /// second, without the driver's text.
    fn from(_: StoreError) -> Status {
        let status = status_of(
            Problem::StoreUnavailable,
            crate::problem::STORE_UNAVAILABLE,
            Some(Duration::from_secs(1)),
        );
        marked(status, "unfinished")
    }
}

impl Rejected {
    /// `status` marked as a refusal made before the handler did anything: the layer stores
    /// nothing and rolls back the handler's transaction, so a corrected call with the same key
    /// runs.
    pub fn grpc(status: Status) -> Status {
        marked(status, "rejected")
    }
}

impl<S: Store> Execution<S> {
    /// The execution of a guarded call, from its request's extensions; `INTERNAL` when the
    /// call has none: its method is not guarded by a [`GrpcIdempotencyLayer`], or the call
    /// came without a key to a method whose key is optional (it runs unguarded; read
    /// `request.extensions().get::<Execution<S>>()` to tell).
    pub fn of_grpc<T>(request: &tonic::Request<T>) -> Result<Execution<S>, Status> {
        request.extensions().get::<Execution<S>>().cloned().ok_or_else(|| {
            let detail = "this call is not guarded by the idempotency layer: name its method with `grpc_method`";
            status_of(Problem::HandlerFailed, detail, None)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_answer_round_trips_with_and_without_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.append("x-bin", HeaderValue::from_bytes(&[0xff, b'a']).unwrap());
        let data = Bytes::from_static(b"\0\0\0\0\x02hi");
        let encoded = encode_answer(&data, Some(&trailers));
        assert_eq!(
            decode_answer(&encoded).unwrap(),
            (data.clone(), Some(trailers))
        );
        let bare = encode_answer(&data, None);
        assert_eq!(decode_answer(&bare).unwrap(), (data.clone(), None));
        let empty = encode_answer(&Bytes::new(), None);
        assert_eq!(decode_answer(&empty).unwrap(), (Bytes::new(), None));
        for cut in 0..encoded.len() {
            let cut = encoded.slice(..cut);
            assert!(decode_answer(&cut).is_err(), "a cut answer is an error");
        }
        let mut long = bare.to_vec();
        long[0] = 0xff;
        assert!(decode_answer(&Bytes::from(long)).is_err());
        let mut extra = bare.to_vec();
        extra.push(b'x');
        assert!(
            decode_answer(&Bytes::from(extra)).is_err(),
            "bytes after the end"
        );
        let mut extra = encoded.to_vec();
        extra.push(b'x');
        assert!(
            decode_answer(&Bytes::from(extra)).is_err(),
            "bytes after the trailers"
        );
        let none = encode_answer(&data, Some(&HeaderMap::new()));
        assert_eq!(
            decode_answer(&none).unwrap(),
            (data, Some(HeaderMap::new()))
        );
    }

    #[test]
    fn every_own_answer_says_its_problem_and_whether_to_come_back() {
        let grpc = Grpc::default();
        let read = |response: &Response<Bytes>| {
            let h = response.headers();
            let text = |name: &str| h.get(name).map(|v| v.to_str().unwrap().to_owned());
            (
                text("grpc-status").unwrap(),
                text("safe-retry-problem").unwrap(),
                text("grpc-retry-pushback-ms"),
            )
        };
        let answer = grpc.own(
            Problem::InProgress,
            "running",
            Some(Duration::from_millis(1500)),
        );
        assert_eq!(answer.status(), 200);
        assert_eq!(
            read(&answer),
            ("14".into(), "in-progress".into(), Some("1500".into()))
        );
        let answer = grpc.own(
            Problem::TakenOver,
            "finishing elsewhere",
            Some(Duration::from_millis(1000)),
        );
        assert_eq!(
            read(&answer),
            ("14".into(), "taken-over".into(), Some("1000".into()))
        );
        let answer = grpc.own(Problem::KeyReused, "another call", None);
        assert_eq!(
            read(&answer),
            ("9".into(), "key-reused".into(), Some("-1".into()))
        );
        let answer = grpc.own(Problem::MissingKey, "none", None);
        assert_eq!(
            read(&answer),
            ("3".into(), "missing-key".into(), Some("-1".into()))
        );
        let answer = grpc.own(Problem::BodyTimeout, "slow", None);
        assert_eq!(read(&answer), ("4".into(), "body-timeout".into(), None));
        let message = answer
            .headers()
            .get("grpc-message")
            .unwrap()
            .to_str()
            .unwrap();
        assert!(message.starts_with("body-timeout"), "{message}");
    }

    #[test]
    fn a_mark_is_read_and_taken_out_and_unstored_codes_are_unfinished() {
        let grpc = Grpc {
            not_stored: vec![Code::ResourceExhausted],
        };
        let head = |status: Status| status.into_http::<()>().into_parts().0;
        let mut fenced = head(Status::from(StepError::Fenced));
        assert_eq!(grpc.mark(&mut fenced), Some(Mark::Fenced));
        assert!(fenced.headers.get(MARK).is_none(), "the mark never leaves");
        let mut rejected = head(Rejected::grpc(Status::invalid_argument("amount")));
        assert_eq!(grpc.mark(&mut rejected), Some(Mark::Rejected));
        let mut store = head(Status::from(StoreError::new("down")));
        assert_eq!(grpc.mark(&mut store), Some(Mark::Unfinished));
        let mut busy = head(Status::resource_exhausted("busy"));
        assert_eq!(grpc.mark(&mut busy), Some(Mark::Unfinished));
        let mut other = head(Status::not_found("no such account"));
        assert_eq!(grpc.mark(&mut other), None);
        let mut ok = Response::new(()).into_parts().0;
        assert_eq!(grpc.mark(&mut ok), None);
    }

    #[test]
    fn a_replay_is_the_stored_answer_marked_and_a_garbled_one_an_internal_status() {
        let grpc = Grpc::default();
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let stored = StoredAnswer {
            status: http::StatusCode::OK,
            headers: vec![(
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/grpc"),
            )],
            body: Some(encode_answer(&Bytes::from_static(b"m"), Some(&trailers))),
        };
        let replay = grpc.replay(&stored, false);
        assert_eq!(replay.headers()["content-type"], "application/grpc");
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.body().data, "m");
        assert_eq!(replay.body().trailers.as_ref(), Some(&trailers));
        let garbled = StoredAnswer {
            body: Some(Bytes::from_static(b"garbled")),
            ..stored.clone()
        };
        let replay = grpc.replay(&garbled, false);
        assert_eq!(replay.headers()["grpc-status"], "13");
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        let too_large = StoredAnswer {
            body: None,
            ..stored
        };
        let replay = grpc.replay(&too_large, false);
        assert_eq!(replay.headers()["grpc-status"], "15");
        assert_eq!(replay.headers()["safe-retry-problem"], "answer-not-stored");
    }

    #[test]
    fn the_crate_s_errors_become_statuses_by_what_failed() {
        let problem = |status: &Status| {
            let value = status.metadata().get(PROBLEM).unwrap();
            (status.code(), value.to_str().unwrap().to_owned())
        };
        let store = || StoreError::new("down");
        let cases = [
            (
                Status::from(StepError::Store(store())),
                Code::Unavailable,
                "store-unavailable",
            ),
            (
                Status::from(StepError::Fenced),
                Code::Unavailable,
                "in-progress",
            ),
            (
                Status::from(StepError::Misuse("twice")),
                Code::Unavailable,
                "step-unfinished",
            ),
            (
                Status::from(LocalError::Store(store())),
                Code::Unavailable,
                "store-unavailable",
            ),
            (
                Status::from(LocalError::AlreadyHeld),
                Code::Internal,
                "handler-failed",
            ),
            (
                Status::from(store()),
                Code::Unavailable,
                "store-unavailable",
            ),
        ];
        for (status, code, name) in cases {
            assert_eq!(problem(&status), (code, name.to_owned()), "{status:?}");
        }
    }

    /// A handler that counts its calls and answers an empty `OK`; ready when `ready` says.
    #[derive(Clone)]
    struct Counting {
        calls: Arc<std::sync::atomic::AtomicUsize>,
        ready: bool,
    }

    impl std::fmt::Debug for Counting {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Counting")
        }
    }

    impl Service<Request<tonic::body::Body>> for Counting {
        type Response = Response<http_body_util::Full<Bytes>>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            if self.ready {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        }

        fn call(&mut self, _: Request<tonic::body::Body>) -> Self::Future {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::future::ready(Ok(Response::new(http_body_util::Full::default())))
        }
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn the_service_waits_for_its_handler_and_passes_the_reconciler_s_requests() {
        let store = crate::store::SqliteStore::memory().await.unwrap();
        let layer = crate::IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .grpc_method("/bank.Bank/Charge")
            .build_grpc()
            .unwrap();
        let calls = Arc::default();
        let mut busy = layer.layer(Counting {
            calls: Arc::clone(&calls),
            ready: false,
        });
        let readiness = std::future::poll_fn(|cx| Poll::Ready(busy.poll_ready(cx))).await;
        assert!(readiness.is_pending());
        assert_eq!(
            format!("{busy:?}"),
            "GrpcIdempotent { inner: Counting, .. }"
        );
        let mut service = layer.layer(Counting {
            calls: Arc::clone(&calls),
            ready: true,
        });
        let resumed = || {
            let mut request = Request::post("/bank.Bank/Charge")
                .body(tonic_body(Bytes::from_static(b"\0\0\0\0\0")))
                .unwrap();
            request.extensions_mut().insert(Resumed);
            request
        };
        for _ in 0..2 {
            let answer = service.call(resumed()).await.unwrap();
            assert!(
                answer.headers().get("grpc-status").is_none(),
                "the handler's own"
            );
        }
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
        let record = crate::store::Outcomes::read(&store, "", "anything")
            .await
            .unwrap();
        assert!(record.is_none());
        let keyless = Request::post("/bank.Bank/Charge")
            .body(tonic_body(Bytes::new()))
            .unwrap();
        let refused = service.call(keyless).await.unwrap();
        assert_eq!(refused.headers()["safe-retry-problem"], "missing-key");
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn a_grpc_fingerprint_is_never_an_http_one() {
        let grpc = Grpc::default();
        assert_ne!(grpc.fingerprint([7; 32]), [7; 32]);
        assert_eq!(grpc.fingerprint([7; 32]), grpc.fingerprint([7; 32]));
        assert_ne!(grpc.fingerprint([7; 32]), grpc.fingerprint([8; 32]));
    }
}
