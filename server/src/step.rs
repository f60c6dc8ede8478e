//! Recovery points: a handler's work as named steps, each committed with the record, so that
//! a resumed request skips what is done and starts at the first step not done.

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Response, header};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::config::Count;
use crate::events::{Event, emit};
use crate::execution::Execution;
use crate::markers::FencedStep;
pub use crate::markers::Unfinished;
use crate::problem::Problem;
use crate::store::{Completion, StagedMessage, StepWrite, Store, StoreError};

/// The natural key of one of a record's effects: the scope and key, length-prefixed so that no
/// two keys share one, then the record's identity (random, drawn when the record was created
/// or renewed after its retention), the kind (`step`, `outbox`) and the effect's name. Every
/// attempt, takeover and resumption of one record derives the same; a renewed key, another
/// row or another database, another.
pub(crate) fn natural(scope: &str, key: &str, identity: &str, kind: &str, name: &str) -> String {
    format!(
        "safe-retry/{}:{scope}/{}:{key}/{identity}/{kind}/{name}",
        scope.len(),
        key.len(),
    )
}

/// Where a step stands, as [`Execution::step`] finds it.
#[derive(Debug)]
pub enum Step<S: Store, T> {
    /// An earlier attempt committed it: its output, as committed.
    Done(T),
    /// Not committed yet: do the work, then [`commit`](Pending::commit) its output.
    Todo(Pending<S, T>),
}

/// A step to do: its transaction (for local effects and outbox messages that commit with it),
/// its downstream key, and its commit.
///
/// Dropped without a commit, the step is not done: its transaction rolls back and a resumption
/// runs it again.
pub struct Pending<S: Store, T> {
    execution: Execution<S>,
    name: Arc<str>,
    tx: Option<S::Tx>,
    output: PhantomData<fn(T)>,
}

impl<S: Store, T> fmt::Debug for Pending<S, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending")
            .field("name", &self.name)
            .field("tx_open", &self.tx.is_some())
            .finish_non_exhaustive()
    }
}

/// Why a step could not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// Another attempt took the record over: nothing of this step was written. Stop; the
    /// other attempt finishes the request.
    #[error("another attempt took this record over; this step was not committed")]
    Fenced,
    /// The store failed; the step was not committed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A step's output could not be written as JSON, or an earlier attempt's could not be read
    /// as this step's output type.
    #[error("a step's output does not (de)serialize: {0}")]
    Output(#[source] serde_json::Error),
    /// A step's external call failed without an answer, after the client's own retries. The
    /// step is not done; a resumption calls again with the same downstream key.
    #[cfg(feature = "client")]
    #[error("the step's external call failed: {0}")]
    Call(#[source] reqwest_middleware::Error),
    /// A step's external call was answered with a transient status (`408`, `429`, `5xx`)
    /// after the client's own retries: whether the effect happened is not known yet. The step
    /// is not done; a resumption calls again with the same downstream key.
    #[error("the step's dependency answered {0} after the client's retries")]
    Unavailable(http::StatusCode),
    /// A step was used wrongly: an external call with the step's transaction open, or
    /// through a client without this workspace's middleware (no key on the call).
    #[error("{0}")]
    Misuse(&'static str),
}

impl StepError {
    /// The answer for a caller whose request stopped at this error, marked [`Unfinished`]
    /// (nothing is stored): when another attempt holds the record, what happened to it (the
    /// layer replays its outcome once completed, else `409` `in-progress`); when the store
    /// failed, `503` `store-unavailable`; else `503` `step-unfinished`; each with a retry hint.
    /// No error's inner text (a driver's, a dependency's URL) reaches the caller.
    pub fn response(&self) -> Response<Bytes> {
        let mut response = match self {
            StepError::Fenced => {
                let mut fenced = Problem::in_progress(std::time::Duration::from_secs(1));
                fenced.extensions_mut().insert(FencedStep);
                fenced
            }
            StepError::Store(_) => Problem::store_unavailable(),
            _ => {
                let mut unfinished = Problem::StepUnfinished.response(&format!(
                    "{}; the request is kept at its last recovery point; retry with the same key",
                    self.public_reason()
                ));
                crate::problem::retry_hint(&mut unfinished, std::time::Duration::from_secs(1));
                unfinished
            }
        };
        response.extensions_mut().insert(Unfinished);
        response
    }

    /// What a caller may be told of this error.
    pub(crate) fn public_reason(&self) -> String {
        match self {
            StepError::Fenced => "another attempt holds this request".into(),
            StepError::Store(_) => "the outcome store failed".into(),
            StepError::Output(_) => "a step's output could not be kept".into(),
            #[cfg(feature = "client")]
            StepError::Call(_) => "a step's dependency did not answer".into(),
            StepError::Unavailable(status) => {
                format!("a step's dependency answered {status} after the client's retries")
            }
            StepError::Misuse(misuse) => (*misuse).into(),
        }
    }
}

impl From<crate::execution::LocalError> for StepError {
    fn from(error: crate::execution::LocalError) -> StepError {
        use crate::execution::LocalError;
        match error {
            LocalError::Store(error) => StepError::Store(error),
            LocalError::AlreadyHeld => {
                StepError::Misuse("this request's transaction is already held by another Local")
            }
            LocalError::Finished => StepError::Misuse("this request's execution has finished"),
            LocalError::NoExecution => StepError::Misuse(
                "no idempotent execution on this request: put the layer on this route and method",
            ),
        }
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for StepError {
    fn into_response(self) -> axum_core::response::Response {
        let (parts, body) = self.response().into_parts();
        axum_core::response::Response::from_parts(parts, axum_core::body::Body::from(body))
    }
}

impl<S: Store> Execution<S> {
    /// Where the step `name` stands: [`Step::Done`] with its output when an earlier attempt
    /// committed it, else [`Step::Todo`].
    ///
    /// Steps run in the same order on every attempt, each name once per request. A resumed
    /// request runs the handler again from its start; each committed step returns its output
    /// at once and the work resumes at the first step not done.
    pub async fn step<T: DeserializeOwned>(&self, name: &str) -> Result<Step<S, T>, StepError> {
        self.load_journal().await?;
        let done = lock(&self.inner().journal).steps.get(name).cloned();
        match done {
            Some(output) => Ok(Step::Done(
                serde_json::from_value(output).map_err(StepError::Output)?,
            )),
            None => Ok(Step::Todo(Pending {
                execution: self.clone(),
                name: name.into(),
                tx: None,
                output: PhantomData,
            })),
        }
    }

    /// The natural key a step's external call derives its idempotency key from: the same for
    /// (scope, key, record, step) on every attempt, takeover and resumption of the record, on
    /// every server; a new one once the key is renewed after its retention, so a dependency
    /// that keeps its keys longer than this layer never replays an old effect for a new request.
    pub fn natural_key(&self, step: &str) -> String {
        natural(
            self.scope(),
            self.key(),
            &self.inner().identity,
            "step",
            step,
        )
    }

    /// Stages an outbox message in `tx` (a step's transaction, or the request's
    /// [`Local`](crate::Local)): the relay delivers it once `tx` commits, never before.
    /// Staging a message of the same name again (a resumed request) adds nothing.
    pub async fn stage(&self, tx: &mut S::Tx, message: &Message) -> Result<(), StoreError> {
        let id = natural(
            self.scope(),
            self.key(),
            &self.inner().identity,
            "outbox",
            &message.name,
        );
        self.inner()
            .store
            .stage(
                tx,
                &StagedMessage {
                    id: &id,
                    method: message.method.as_str(),
                    url: &message.url,
                    headers: &message.headers,
                    body: &message.body,
                },
            )
            .await?;
        Ok(())
    }

    async fn load_journal(&self) -> Result<(), StoreError> {
        let inner = self.inner();
        if lock(&inner.journal).loaded {
            return Ok(());
        }
        let progress = inner.store.progress(inner.fence).await?;
        let steps = match progress.steps.as_deref() {
            Some(text) => serde_json::from_str::<Map<String, Value>>(text)
                .map_err(|_| StoreError::new("a record's steps are not a JSON object"))?,
            None => Map::new(),
        };
        let mut journal = lock(&inner.journal);
        if !journal.loaded {
            journal.loaded = true;
            journal.steps = steps;
            journal.request_saved = progress.request.is_some();
        }
        Ok(())
    }

    /// Commits a recovery point; `output` adds a committed step.
    async fn commit_point(
        &self,
        tx: Option<S::Tx>,
        point: &str,
        output: Option<(&str, Value)>,
    ) -> Result<(), StepError> {
        let inner = self.inner();
        let (steps, request) = {
            let journal = lock(&inner.journal);
            let steps = match &output {
                Some((name, value)) => {
                    let mut steps = journal.steps.clone();
                    steps.insert((*name).to_owned(), value.clone());
                    Some(Value::Object(steps).to_string())
                }
                None => None,
            };
            let request = (!journal.request_saved).then(|| inner.snapshot.encode());
            (steps, request)
        };
        let write = StepWrite {
            point,
            steps: steps.as_deref(),
            request: request.as_deref(),
            lease: inner.lease,
        };
        match inner.store.commit_step(tx, inner.fence, &write).await? {
            // Counted and logged where the layer answers it (`Ended::Fenced`).
            Completion::Fenced => Err(StepError::Fenced),
            Completion::Completed => {
                inner.counters.add(Count::Steps);
                let (scope, key) = (self.scope(), self.key());
                emit!(inner.events, Event::Step, scope, key, point);
                let mut journal = lock(&inner.journal);
                journal.request_saved = true;
                if let Some((name, value)) = output {
                    journal.steps.insert(name.to_owned(), value);
                }
                Ok(())
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<S: Store, T: Serialize> Pending<S, T> {
    /// The step's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The step's transaction, begun on the first call: local effects written in it commit
    /// with the step. Under SQLite it holds the database's one writer: open it after any
    /// external call, not before.
    pub async fn tx(&mut self) -> Result<&mut S::Tx, StoreError> {
        if self.tx.is_none() {
            self.tx = Some(self.execution.inner().store.begin().await?);
        }
        Ok(self.tx.as_mut().expect("begun above"))
    }

    /// Stages an outbox message in the step's transaction: it is delivered once the step
    /// commits, and never if it does not.
    pub async fn stage(&mut self, message: &Message) -> Result<(), StoreError> {
        let execution = self.execution.clone();
        let tx = self.tx().await?;
        execution.stage(tx, message).await
    }

    /// The natural key this step's external call derives its idempotency key from.
    pub fn natural_key(&self) -> String {
        self.execution.natural_key(&self.name)
    }

    /// Commits the step with `output` (and the local effects and messages of its
    /// transaction), fenced: when another attempt has taken the record over, nothing is
    /// written and the error is [`StepError::Fenced`]. Returns the output, for the next step.
    pub async fn commit(mut self, output: T) -> Result<T, StepError> {
        let value = serde_json::to_value(&output).map_err(StepError::Output)?;
        let point = format!("{}:done", self.name);
        let name = self.name.clone();
        self.execution
            .commit_point(self.tx.take(), &point, Some((&name, value)))
            .await?;
        Ok(output)
    }

    /// The recovery point before an external call: the record shows the call may have been
    /// made, with the request saved for a resumption, and the lease renewed.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    async fn started(&mut self) -> Result<(), StepError> {
        if self.tx.is_some() {
            return Err(StepError::Misuse(
                "make a step's external call before opening its transaction",
            ));
        }
        let point = format!("{}:started", self.name);
        self.execution.commit_point(None, &point, None).await
    }
}

#[cfg(feature = "client")]
mod client {
    use super::*;
    use crate::outgoing::{NO_MIDDLEWARE, Verdict, sent_with_key, verdict};
    use http::StatusCode;
    use reqwest_safe_retry::NaturalKey;

    /// A dependency's answer to a step's external call.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Downstream {
        /// The status.
        pub status: StatusCode,
        /// Whether the dependency said it replayed an earlier answer
        /// (`Idempotent-Replayed: true`): a resumed call whose first try had reached it.
        pub replayed: bool,
        /// The body.
        pub body: Bytes,
    }

    impl<S: Store, T: Serialize> Pending<S, T> {
        /// Calls another service for this step through the `reqwest-safe-retry` client that
        /// built `request`, with the idempotency key derived from the record and the step
        /// ([`natural_key`](Pending::natural_key)): every attempt of every resumption sends the
        /// same key, so the dependency performs the effect once.
        ///
        /// Before the call it commits the step's `started` recovery point (saving the request
        /// for a resumption and renewing the lease); a fenced holder never calls. The answer
        /// is returned when it is final (`2xx`, `3xx`, a `4xx` but `408`, `409`, `425` and
        /// `429`, as the outbox relay reads a status), for the
        /// handler to keep what it needs in the step's output. A call that fails without an
        /// answer (after the client's retries) is [`StepError::Call`]; one answered with a
        /// transient status is [`StepError::Unavailable`]: neither says whether the effect
        /// happened, so the step stays undone for a resumption to call again.
        pub async fn call(
            &mut self,
            request: reqwest_middleware::RequestBuilder,
        ) -> Result<Downstream, StepError> {
            self.started().await?;
            let response = request
                .with_extension(NaturalKey::new(self.natural_key()))
                .send()
                .await
                .map_err(StepError::Call)?;
            if !sent_with_key(&response) {
                return Err(StepError::Misuse(NO_MIDDLEWARE));
            }
            let status = response.status();
            if verdict(status) == Verdict::Transient {
                return Err(StepError::Unavailable(status));
            }
            let replayed = response
                .headers()
                .get(crate::headers::IDEMPOTENT_REPLAYED)
                .is_some_and(|v| v == "true");
            let body = response
                .bytes()
                .await
                .map_err(|error| StepError::Call(error.into()))?;
            Ok(Downstream {
                status,
                replayed,
                body,
            })
        }
    }
}

#[cfg(feature = "client")]
pub use client::Downstream;

/// A follow-on message a handler stages in its outbox: a request the relay delivers at least
/// once after the transaction that staged it commits, with an idempotency key derived from the
/// message's id (the record's scope, key and identity, and the message's name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub(crate) name: String,
    pub(crate) method: Method,
    pub(crate) url: String,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

impl Message {
    /// A `POST` of an empty body to `url`, named `name` (unique among the request's
    /// messages).
    pub fn post(name: impl Into<String>, url: impl Into<String>) -> Message {
        Message {
            name: name.into(),
            method: Method::POST,
            url: url.into(),
            headers: Vec::new(),
            body: Bytes::new(),
        }
    }

    /// A message for RabbitMQ, published to `exchange` (`""` for the default exchange, which
    /// routes by queue name) with `routing_key` by a relay given a channel
    /// (`Relay::rabbitmq`, feature `rabbitmq`). Its `message_id` is
    /// the message's derived key; its headers go as AMQP headers (`content-type` as the
    /// content type).
    pub fn rabbitmq(
        name: impl Into<String>,
        exchange: &str,
        routing_key: impl AsRef<str>,
    ) -> Message {
        let exchange = exchange.replace('%', "%25").replace('/', "%2F");
        Message::post(
            name,
            format!("rabbitmq:{exchange}/{}", routing_key.as_ref()),
        )
        .method(Method::from_bytes(b"PUBLISH").expect("a token"))
    }

    /// A message for NATS JetStream, published to `subject` (which a stream must capture) by
    /// a relay given a JetStream context (`Relay::nats`, feature
    /// `nats`). Its `Nats-Msg-Id` is the message's derived key, so the stream's duplicate
    /// window drops a publish made again; its headers go as NATS headers.
    pub fn nats(name: impl Into<String>, subject: impl AsRef<str>) -> Message {
        Message::post(name, format!("nats:{}", subject.as_ref()))
            .method(Method::from_bytes(b"PUBLISH").expect("a token"))
    }

    /// Another method.
    pub fn method(mut self, method: Method) -> Message {
        self.method = method;
        self
    }

    /// Adds a header.
    pub fn header(mut self, name: HeaderName, value: HeaderValue) -> Message {
        self.headers.push((name, value));
        self
    }

    /// A JSON body, with `content-type: application/json`.
    pub fn json(mut self, body: &Value) -> Message {
        self.headers.push((
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        ));
        self.body = Bytes::from(body.to_string());
        self
    }

    /// A body as it is.
    pub fn body(mut self, body: impl Into<Bytes>) -> Message {
        self.body = body.into();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_keys_of_different_records_and_effects_never_meet() {
        // The lengths keep "a/b" + "c" apart from "a" + "b/c".
        assert_ne!(
            natural("a/b", "c", "1.1", "step", "x"),
            natural("a", "b/c", "1.1", "step", "x")
        );
        assert_ne!(
            natural("s", "k", "1.1", "step", "x"),
            natural("s", "k", "1.1", "outbox", "x")
        );
        // Another record (renewed, another row, another database) has another identity.
        assert_ne!(
            natural("s", "k", "1.1", "step", "x"),
            natural("s", "k", "1.4", "step", "x")
        );
        // A record made before identities keeps the keys its row id and generation gave it.
        assert_eq!(
            natural("tenant", "k-1", "12.3", "step", "charge"),
            "safe-retry/6:tenant/3:k-1/12.3/step/charge"
        );
    }

    #[test]
    fn a_step_error_answers_unfinished_and_fenced_as_in_progress() {
        let fenced = StepError::Fenced.response();
        assert_eq!(fenced.status(), 409);
        assert!(fenced.extensions().get::<Unfinished>().is_some());
        assert!(fenced.extensions().get::<FencedStep>().is_some());
        let misuse = StepError::Misuse("x").response();
        assert_eq!(misuse.status(), 503);
        assert_eq!(misuse.headers()[header::RETRY_AFTER], "1");
        assert_eq!(misuse.headers()["retry-after-ms"], "1000");
        assert!(misuse.extensions().get::<FencedStep>().is_none());
        assert!(misuse.extensions().get::<Unfinished>().is_some());
        let body: Value = serde_json::from_slice(misuse.body()).unwrap();
        assert_eq!(body["type"], "urn:safe-retry:problem:step-unfinished");
        let store = StepError::Store(StoreError::new("database is locked")).response();
        assert_eq!(store.status(), 503);
        assert!(store.extensions().get::<Unfinished>().is_some());
        let body: Value = serde_json::from_slice(store.body()).unwrap();
        assert_eq!(body["type"], "urn:safe-retry:problem:store-unavailable");
        // No driver's text reaches the caller.
        assert!(!String::from_utf8_lossy(store.body()).contains("locked"));
        let output = serde_json::from_str::<u8>("x").unwrap_err();
        let output = StepError::Output(output).response();
        assert!(!String::from_utf8_lossy(output.body()).contains("expected"));
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_pending_step_shows_its_name_and_its_key_comes_from_the_record() {
        use crate::execution::{Claimed, Snapshot};
        use crate::store::{Claim, Outcomes};
        let store = crate::store::SqliteStore::memory().await.unwrap();
        let claimed = store
            .try_claim(&Claim {
                scope: "tenant",
                key: "k-1",
                fingerprint: &[0; 32],
                lease: std::time::Duration::from_secs(30),
                retention: std::time::Duration::from_secs(60),
            })
            .await
            .unwrap()
            .unwrap();
        let request = http::Request::post("/orders").body(()).unwrap();
        let (parts, ()) = request.into_parts();
        let execution = Execution::new(
            store,
            Claimed {
                scope: "tenant".into(),
                key: "k-1".into(),
                identity: claimed.identity.as_str().into(),
                fence: claimed.fence,
                taken_over: false,
                lease: std::time::Duration::from_secs(30),
                counters: Default::default(),
                snapshot: Snapshot::of(&parts, &Bytes::new(), &Arc::from([])),
                events: Default::default(),
            },
        );
        let Step::Todo(mut pending) = execution.step::<u32>("charge").await.unwrap() else {
            panic!("a new record has no steps done");
        };
        assert_eq!(pending.name(), "charge");
        assert_eq!(
            pending.natural_key(),
            format!("safe-retry/6:tenant/3:k-1/{}/step/charge", claimed.identity)
        );
        assert_eq!(claimed.identity.len(), 32, "128 random bits, in hex");
        assert_eq!(
            format!("{pending:?}"),
            "Pending { name: \"charge\", tx_open: false, .. }"
        );
        pending.tx().await.unwrap();
        assert!(format!("{pending:?}").contains("tx_open: true"));
        // An external call with the step's transaction open is refused before anything.
        assert!(matches!(pending.started().await, Err(StepError::Misuse(_))));
        assert_eq!(pending.commit(7).await.unwrap(), 7);
        assert!(matches!(
            execution.step::<u32>("charge").await.unwrap(),
            Step::Done(7)
        ));
        // The output as another type is an error, not a panic.
        assert!(matches!(
            execution.step::<String>("charge").await,
            Err(StepError::Output(_))
        ));
    }
}
