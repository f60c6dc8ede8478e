//! The consumer front: a message from a queue or a stream, processed once per (scope, message
//! id) on the engine, and what the broker must then do with it — acknowledge it, deliver it
//! again later, or send it to the dead letters with its reason. A broker's adapter is a loop
//! that turns its deliveries into [`Delivery`]s and carries out the [`Verdict`]s; RabbitMQ's
//! and NATS JetStream's are here, behind features.

#[cfg(feature = "nats")]
pub(crate) mod nats;
#[cfg(feature = "rabbitmq")]
pub(crate) mod rabbitmq;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::response::Parts as Head;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;

use crate::body::{BoxError, Whole};
use crate::config::{Config, Counters};
use crate::engine::{Asked, Ended, run_to_end};
use crate::headers::{IDEMPOTENT_REPLAYED, end_to_end};
use crate::problem::Problem;
use crate::store::{Store, StoredAnswer};
use crate::transport::{Front, Mark};

/// The header a [`Delivery`]'s id travels in to the handler, and where the consumer layer reads
/// its key unless the builder names another source (`KeySource::json_pointer("/id")` for an
/// event id in the payload).
pub const MESSAGE_ID: HeaderName = HeaderName::from_static("safe-retry-message-id");

/// The header of the layer's own answers that names their [`Problem`]; a stored answer of a
/// record that ended failed keeps it, so its redeliveries go to the dead letters too.
const PROBLEM: HeaderName = HeaderName::from_static("safe-retry-problem");

/// The header of the layer's own answers that says, in milliseconds, when to deliver again.
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// One message as a broker delivered it: its id (the key), where it came from, its headers and
/// its payload. The handler sees it as a `POST` to `/<source>` (the source percent-encoded where
/// a path needs it) with the payload as the body, the headers that are valid HTTP headers, and
/// the id in [`MESSAGE_ID`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    id: Option<String>,
    source: String,
    headers: HeaderMap,
    payload: Bytes,
}

impl Delivery {
    /// A message from `source` (a queue's name, a subject) with `payload`, and no id yet.
    pub fn new(source: impl Into<String>, payload: impl Into<Bytes>) -> Delivery {
        Delivery {
            id: None,
            source: source.into(),
            headers: HeaderMap::new(),
            payload: payload.into(),
        }
    }

    /// The message's id, which the publisher set once for every copy of it (RabbitMQ's
    /// `message_id`, JetStream's `Nats-Msg-Id`, an SQS message's deduplication id, a Kafka
    /// record's key header).
    pub fn id(mut self, id: impl Into<String>) -> Delivery {
        self.id = Some(id.into());
        self
    }

    /// A header of the message. A name or value that HTTP cannot carry is left out.
    pub fn header(mut self, name: &str, value: &[u8]) -> Delivery {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            self.headers.append(name, value);
        }
        self
    }

    /// The message's id, if it has one.
    pub fn message_id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// Where the message came from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The message's payload.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The request the handler is given.
    fn request<B: From<Bytes>>(&self) -> Request<B> {
        let mut request = Request::new(B::from(self.payload.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = path_of(&self.source)
            .parse()
            .unwrap_or_else(|_| http::Uri::from_static("/"));
        *request.headers_mut() = self.headers.clone();
        request.headers_mut().remove(&MESSAGE_ID);
        if let Some(id) = self
            .id
            .as_deref()
            .and_then(|id| HeaderValue::from_str(id).ok())
        {
            request.headers_mut().insert(MESSAGE_ID, id);
        }
        request
    }
}

/// `/` and the source, every byte but unreserved ones and `.` `:` `@` `-` `_` `~` `!` `$` `&`
/// `'` `(` `)` `*` `+` `,` `;` `=` percent-encoded, so any queue's or subject's name is a path.
fn path_of(source: &str) -> String {
    let mut path = String::with_capacity(source.len() + 1);
    path.push('/');
    for byte in source.bytes() {
        if byte.is_ascii_alphanumeric() || b".:@-_~!$&'()*+,;=".contains(&byte) {
            path.push(byte as char);
        } else {
            path.push_str(&format!("%{byte:02X}"));
        }
    }
    path
}

/// What the broker must do with a delivery once the consumer has decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Acknowledge it: its outcome is stored (now, or by an earlier delivery of the same
    /// message).
    Ack,
    /// Deliver it again after `after`, unacknowledged until then: the same message is still in
    /// progress under another consumer, the store failed, or the handler did not finish. Nothing
    /// of it is lost, and it does not run twice at once.
    Retry {
        /// The wait before it is delivered again.
        after: Duration,
    },
    /// Send it to the dead letters with this reason, then acknowledge it: running it again
    /// would not change the answer.
    DeadLetter(DeadLetter),
}

/// Why a message went to the dead letters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The reason's name: a [`Problem`]'s name (`key-reused`, `missing-key`,
    /// `malformed-key`, `no-scope`, `body-too-large`, `gave-up`), or `rejected` when the
    /// handler marked its answer [`Rejected`](crate::Rejected).
    pub reason: &'static str,
    /// What happened, in words (for the operator reading the dead letters).
    pub detail: String,
}

/// The consumer front's words: the layer's own answers name their problem in a header, a stored
/// answer is the handler's status, headers and body.
#[derive(Debug, Clone, Default)]
pub(crate) struct Consume {
    pub(crate) not_stored: Vec<StatusCode>,
}

impl Front for Consume {
    fn own(
        &self,
        problem: Problem,
        detail: &str,
        retry_after: Option<Duration>,
    ) -> Response<Bytes> {
        let mut response = Response::new(Bytes::copy_from_slice(detail.as_bytes()));
        *response.status_mut() = problem.status();
        let headers = response.headers_mut();
        headers.insert(PROBLEM, HeaderValue::from_static(problem.name()));
        if let Some(after) = retry_after {
            headers.insert(RETRY_AFTER_MS, HeaderValue::from(after.as_millis() as u64));
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

    fn replay(&self, stored: &StoredAnswer, _: bool) -> Response<Whole> {
        let mut response = Response::new(Whole {
            data: stored.body.clone().unwrap_or_default(),
            trailers: None,
        });
        *response.status_mut() = stored.status;
        let headers = response.headers_mut();
        for (name, value) in &stored.headers {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }
}

/// What an answer tells the broker, before the dead letter's detail is read: by the problem
/// the layer named, else by how the execution ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decided {
    Ack,
    Retry(Duration),
    DeadLetter(&'static str),
}

fn decide(headers: &HeaderMap, ended: Option<Ended>, retry_after: Duration) -> Decided {
    let after = headers
        .get(&RETRY_AFTER_MS)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .map_or(retry_after, Duration::from_millis);
    let problem = headers.get(&PROBLEM).and_then(|v| v.to_str().ok());
    match problem {
        Some(
            "in-progress" | "store-unavailable" | "step-unfinished" | "handler-failed"
            | "taken-over",
        ) => {
            return Decided::Retry(after);
        }
        Some("body-timeout" | "body-unreadable") => return Decided::Retry(after),
        Some(
            name @ ("gave-up" | "key-reused" | "missing-key" | "malformed-key" | "no-scope"
            | "body-too-large"),
        ) => {
            // A `&'static str` of the same name.
            let name = DEAD_LETTER_REASONS
                .iter()
                .find(|reason| **reason == name)
                .copied()
                .unwrap_or("gave-up");
            return Decided::DeadLetter(name);
        }
        _ => {}
    }
    match ended {
        Some(Ended::Rejected) => Decided::DeadLetter("rejected"),
        Some(Ended::Unfinished | Ended::StoreFailed) => Decided::Retry(after),
        Some(Ended::Failed) => Decided::DeadLetter("gave-up"),
        Some(Ended::Completed | Ended::Fenced) | None => Decided::Ack,
    }
}

/// The reasons a message goes to the dead letters for.
const DEAD_LETTER_REASONS: [&str; 7] = [
    "gave-up",
    "key-reused",
    "missing-key",
    "malformed-key",
    "no-scope",
    "body-too-large",
    "rejected",
];

/// A consumer layer: the engine's settings for messages, from
/// [`Builder::build_consumer`](crate::Builder::build_consumer). Make a [`Consumer`] of a
/// handler with [`consumer`](ConsumerLayer::consumer), and a
/// [`Reconciler`](crate::Reconciler) with `reconciler`.
pub struct ConsumerLayer<S> {
    pub(crate) config: Arc<Config<S>>,
}

impl<S> Clone for ConsumerLayer<S> {
    fn clone(&self) -> Self {
        ConsumerLayer {
            config: self.config.clone(),
        }
    }
}

impl<S> fmt::Debug for ConsumerLayer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerLayer")
            .field("key", &self.config.key)
            .field("lease", &self.config.lease)
            .field("retry_after", &self.config.in_progress_retry_after)
            .field("max_attempts", &self.config.max_attempts)
            .field("retention", &self.config.retention)
            .finish_non_exhaustive()
    }
}

impl<S: Store> ConsumerLayer<S> {
    /// A consumer that runs `handler` once per (scope, message id): a tower service of
    /// `http::Request`s (an axum `Router` with a route per source, or `tower::service_fn`),
    /// whose `Local` and `Execution` work as on the HTTP layer.
    pub fn consumer<Svc>(&self, handler: Svc) -> Consumer<Svc, S> {
        Consumer {
            inner: handler,
            config: self.config.clone(),
        }
    }

    /// What the layer has done, counted since it was built.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.config.counters
    }

    /// The store the layer records outcomes in.
    pub fn store(&self) -> &S {
        &self.config.store
    }
}

/// Processes deliveries once per (scope, message id): the handler's local effects and the
/// outcome commit in one transaction before [`handle`](Consumer::handle) returns
/// [`Verdict::Ack`], so a broker adapter acknowledges only what is stored.
pub struct Consumer<Svc, S> {
    inner: Svc,
    config: Arc<Config<S>>,
}

impl<Svc: Clone, S> Clone for Consumer<Svc, S> {
    fn clone(&self) -> Self {
        Consumer {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<Svc, S> fmt::Debug for Consumer<Svc, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer").finish_non_exhaustive()
    }
}

/// The body of the requests a consumer's handler is given: the payload, whole (the body a
/// reconciler's requests have too, so one handler serves both).
pub(crate) type Payload = crate::body::SavedBody;

impl<Svc, S> Consumer<Svc, S>
where
    Svc: Service<Request<Payload>> + Clone + Send + 'static,
    Svc::Future: Send,
    Svc::Error: Send,
    S: Store,
{
    /// Runs the handler for `delivery` unless its message was processed before, and says what
    /// the broker must do with it. Dropping the future mid-way (a consumer shutting down) ends
    /// the record's lease at once and leaves the message unacknowledged: the broker delivers it
    /// again and it runs from its last recovery point.
    pub async fn handle<R>(&self, delivery: Delivery) -> Verdict
    where
        Svc: Service<Request<Payload>, Response = Response<R>>,
        R: Body<Data = Bytes> + Unpin + Send + 'static,
        R::Error: Into<BoxError>,
    {
        let retry = Verdict::Retry {
            after: self.config.in_progress_retry_after,
        };
        let mut inner = self.inner.clone();
        if std::future::poll_fn(|cx| inner.poll_ready(cx))
            .await
            .is_err()
        {
            return retry;
        }
        let asked = Asked {
            rebody: Payload::from,
            key_required: true,
        };
        let request = delivery.request::<Payload>();
        let (answer, ended) = match run_to_end(&self.config, inner, request, asked).await {
            Ok(ran) => ran,
            // The handler failed without an answer: nothing is stored, the lease is ended.
            Err(_) => return retry,
        };
        let (head, body) = answer.into_parts();
        match decide(&head.headers, ended, self.config.in_progress_retry_after) {
            Decided::Ack => Verdict::Ack,
            Decided::Retry(after) => Verdict::Retry { after },
            Decided::DeadLetter(reason) => {
                let text = match body.collect().await {
                    Ok(read) => String::from_utf8_lossy(&read.to_bytes()).into_owned(),
                    Err(_) => String::new(),
                };
                let detail = if reason == "rejected" {
                    format!(
                        "the handler rejected the message with {}: {text}",
                        head.status
                    )
                } else {
                    text
                };
                Verdict::DeadLetter(DeadLetter {
                    reason,
                    detail: truncated(detail, 1024),
                })
            }
        }
    }
}

/// A broker's next delivery, without a combinator crate.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
async fn next<St: futures_core::Stream + Unpin>(stream: &mut St) -> Option<St::Item> {
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *stream).poll_next(cx)).await
}

/// At most `limit` bytes of `text`, cut at a character's boundary.
fn truncated(mut text: String, limit: usize) -> String {
    let mut end = limit.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own(problem: Problem, after: Option<Duration>) -> HeaderMap {
        Consume::default()
            .own(problem, "d", after)
            .headers()
            .clone()
    }

    #[test]
    fn the_layer_s_answers_tell_the_broker_to_retry_or_dead_letter_by_their_problem() {
        let default = Duration::from_millis(250);
        let after = Some(Duration::from_millis(1_500));
        for problem in [
            Problem::InProgress,
            Problem::StoreUnavailable,
            Problem::StepUnfinished,
            Problem::HandlerFailed,
            Problem::TakenOver,
            Problem::BodyTimeout,
            Problem::BodyUnreadable,
        ] {
            assert_eq!(
                decide(&own(problem, after), None, default),
                Decided::Retry(Duration::from_millis(1_500)),
                "{problem:?}"
            );
            assert_eq!(
                decide(&own(problem, None), Some(Ended::Completed), default),
                Decided::Retry(default),
                "{problem:?} without a wait takes the consumer's"
            );
        }
        for problem in [
            Problem::GaveUp,
            Problem::KeyReused,
            Problem::MissingKey,
            Problem::MalformedKey,
            Problem::NoScope,
            Problem::BodyTooLarge,
        ] {
            assert_eq!(
                decide(&own(problem, None), None, default),
                Decided::DeadLetter(problem.name()),
                "{problem:?}"
            );
        }
    }

    #[test]
    fn the_handler_s_answers_tell_the_broker_by_how_the_execution_ended() {
        let default = Duration::from_millis(250);
        let none = HeaderMap::new();
        assert_eq!(decide(&none, None, default), Decided::Ack, "a replay");
        assert_eq!(decide(&none, Some(Ended::Completed), default), Decided::Ack);
        assert_eq!(decide(&none, Some(Ended::Fenced), default), Decided::Ack);
        assert_eq!(
            decide(&none, Some(Ended::Rejected), default),
            Decided::DeadLetter("rejected")
        );
        assert_eq!(
            decide(&none, Some(Ended::Failed), default),
            Decided::DeadLetter("gave-up")
        );
        for ended in [Ended::Unfinished, Ended::StoreFailed] {
            assert_eq!(decide(&none, Some(ended), default), Decided::Retry(default));
        }
        let mut unknown = HeaderMap::new();
        unknown.insert(PROBLEM, HeaderValue::from_static("what-the-handler-said"));
        assert_eq!(
            decide(&unknown, Some(Ended::Completed), default),
            Decided::Ack,
            "a name the layer never gives is the handler's own header"
        );
    }

    #[test]
    fn every_dead_letter_reason_is_a_problem_s_name_or_rejected() {
        for reason in DEAD_LETTER_REASONS {
            let named = [
                Problem::GaveUp,
                Problem::KeyReused,
                Problem::MissingKey,
                Problem::MalformedKey,
                Problem::NoScope,
                Problem::BodyTooLarge,
            ]
            .iter()
            .any(|p| p.name() == reason);
            assert!(named || reason == "rejected", "{reason}");
        }
    }

    #[test]
    fn a_delivery_is_a_post_to_its_source_with_its_id_and_its_headers() {
        let delivery = Delivery::new("orders created/é", Bytes::from_static(b"{}"))
            .id("m-1")
            .header("x-trace", b"t")
            .header("bad name", b"x")
            .header(MESSAGE_ID.as_str(), b"forged");
        assert_eq!(delivery.message_id(), Some("m-1"));
        assert_eq!(delivery.source(), "orders created/é");
        assert_eq!(delivery.payload(), &Bytes::from_static(b"{}"));
        let request: Request<Bytes> = delivery.request();
        assert_eq!(request.method(), Method::POST);
        assert_eq!(request.uri().path(), "/orders%20created%2F%C3%A9");
        assert_eq!(request.headers()["x-trace"], "t");
        assert_eq!(request.headers().len(), 2, "{:?}", request.headers());
        assert_eq!(request.headers()[&MESSAGE_ID], "m-1");
        assert_eq!(request.body(), &Bytes::from_static(b"{}"));
        let no_id = Delivery::new("q", Bytes::new()).header(MESSAGE_ID.as_str(), b"forged");
        assert_eq!(no_id.message_id(), None);
        let no_id: Request<Bytes> = no_id.request();
        assert!(
            no_id.headers().get(&MESSAGE_ID).is_none(),
            "a header never stands in for the broker's id"
        );
        assert_eq!(path_of("orders.created"), "/orders.created");
    }

    #[test]
    fn a_replay_carries_the_stored_answer_and_the_replay_mark() {
        let stored = StoredAnswer {
            status: StatusCode::ACCEPTED,
            headers: vec![(
                HeaderName::from_static("x-a"),
                HeaderValue::from_static("1"),
            )],
            body: Some(Bytes::from_static(b"done")),
        };
        let replay = Consume::default().replay(&stored, false);
        assert_eq!(replay.status(), StatusCode::ACCEPTED);
        assert_eq!(replay.headers()["x-a"], "1");
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(replay.body().data, Bytes::from_static(b"done"));
        let (mut head, _) = Response::new(()).into_parts();
        head.status = StatusCode::BAD_GATEWAY;
        let front = Consume {
            not_stored: vec![StatusCode::BAD_GATEWAY],
        };
        assert_eq!(front.mark(&mut head), Some(Mark::Unfinished));
        head.status = StatusCode::OK;
        assert_eq!(front.mark(&mut head), None);
        assert_eq!(truncated("héllo".into(), 2), "h");
        assert_eq!(truncated("héllo".into(), 3), "hé");
        assert_eq!(truncated("hé".into(), 9), "hé");
    }
}
