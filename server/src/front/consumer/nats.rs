//! NATS JetStream's adapter (async-nats): a pull consumer's messages through a [`Consumer`],
//! each acknowledged (and the acknowledgement confirmed by the server) only after its outcome
//! commits, negatively acknowledged with a delay while it cannot finish, and published to a
//! dead-letter subject with its reason (acknowledged by JetStream) before it is acknowledged.

use std::sync::Arc;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Context};
use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tokio::sync::Semaphore;
use tower_service::Service;

use super::{Consumer, DeadLetter, Delivery, Payload, Verdict};
use crate::body::BoxError;
use crate::store::Store;

/// The header JetStream deduplicates publishes by, and this adapter reads as the message's id.
const MSG_ID: &str = "Nats-Msg-Id";

/// Consumes a JetStream pull consumer through a [`Consumer`] (feature `nats`).
///
/// - The message's id is its `Nats-Msg-Id` header (the id JetStream deduplicates publishes by
///   within the stream's duplicate window; this crate's outbox relay sets it to the message's
///   derived key). Its other headers reach the handler as HTTP headers.
/// - [`Verdict::Ack`]: acknowledged, and the server's confirmation awaited, after the outcome
///   committed.
/// - [`Verdict::Retry`]: negatively acknowledged with the wait as its delay, so JetStream
///   delivers it again then. Set the consumer's `max_deliver` high or unlimited: this crate's
///   `max_attempts` decides when a message has been tried enough.
/// - [`Verdict::DeadLetter`]: published to the dead-letter subject (which a stream must
///   capture) with `safe-retry-reason`, `safe-retry-detail` and `safe-retry-subject` headers
///   and `Nats-Msg-Id` the message's with `:dead-letter` after it (the original in
///   `safe-retry-message-id`), then acknowledged once JetStream holds it.
///
/// A message whose consumer dies before acknowledging it is delivered again after the
/// consumer's ack wait; it then finds its outcome stored and is acknowledged without its
/// effect, or runs from its last recovery point.
#[derive(Debug, Clone)]
pub struct JetStream {
    context: Context,
    consumer: PullConsumer,
    dead_letters: String,
    concurrency: usize,
}

impl JetStream {
    /// Consumes `consumer`'s messages, publishing dead letters through `context` to
    /// `dead_letters` (a subject a stream captures).
    pub fn new(
        context: Context,
        consumer: PullConsumer,
        dead_letters: impl Into<String>,
    ) -> JetStream {
        JetStream {
            context,
            consumer,
            dead_letters: dead_letters.into(),
            concurrency: 16,
        }
    }

    /// How many messages this adapter processes at once \[16\]: keep the consumer's
    /// `max_ack_pending` at least as high.
    pub fn concurrency(mut self, concurrency: usize) -> JetStream {
        self.concurrency = concurrency.max(1);
        self
    }

    /// Consumes until the consumer's stream of messages ends (then `Ok`) or fails (then its
    /// error, as text). Abort the task to stop: what was not acknowledged is delivered again
    /// after the ack wait.
    pub async fn run<Svc, S, R>(self, consumer: Consumer<Svc, S>) -> Result<(), BoxError>
    where
        Svc: Service<Request<Payload>, Response = Response<R>> + Clone + Send + Sync + 'static,
        Svc::Future: Send,
        Svc::Error: Send,
        S: Store,
        R: Body<Data = Bytes> + Unpin + Send + 'static,
        R::Error: Into<BoxError>,
    {
        // Pulled no faster than they are processed: a message waiting in this client's buffer
        // past the ack wait would be delivered again meanwhile.
        let mut messages = self
            .consumer
            .stream()
            .max_messages_per_batch(self.concurrency)
            .messages()
            .await?;
        let permits = Arc::new(Semaphore::new(self.concurrency));
        let mut running = tokio::task::JoinSet::new();
        let ended = loop {
            let permit = tokio::select! {
                permit = permits.clone().acquire_owned() => permit?,
                Some(_) = running.join_next(), if !running.is_empty() => continue,
            };
            let next = tokio::select! {
                next = super::next(&mut messages) => next,
                Some(_) = running.join_next(), if !running.is_empty() => continue,
            };
            match next {
                None => break Ok(()),
                Some(Err(error)) => break Err(error.into()),
                Some(Ok(message)) => {
                    let (adapter, consumer) = (self.clone(), consumer.clone());
                    running.spawn(async move {
                        adapter.process(&consumer, message).await;
                        drop(permit);
                    });
                }
            }
        };
        while running.join_next().await.is_some() {}
        ended
    }

    /// One message: processed, then settled with the server. A settlement the server does not
    /// take leaves the message for its redelivery after the ack wait.
    async fn process<Svc, S, R>(
        &self,
        consumer: &Consumer<Svc, S>,
        message: async_nats::jetstream::Message,
    ) where
        Svc: Service<Request<Payload>, Response = Response<R>> + Clone + Send + 'static,
        Svc::Future: Send,
        Svc::Error: Send,
        S: Store,
        R: Body<Data = Bytes> + Unpin + Send + 'static,
        R::Error: Into<BoxError>,
    {
        let verdict = consumer.handle(delivery_of(&message)).await;
        let _ = match verdict {
            Verdict::Ack => message.double_ack().await,
            Verdict::Retry { after } => message.ack_with(AckKind::Nak(Some(after))).await,
            Verdict::DeadLetter(dead) => match self.dead_letter(&message, &dead).await {
                Ok(()) => message.double_ack().await,
                Err(_) => {
                    let after = std::time::Duration::from_secs(1);
                    message.ack_with(AckKind::Nak(Some(after))).await
                }
            },
        };
    }

    /// Publishes the dead letter and waits for JetStream's acknowledgement.
    async fn dead_letter(
        &self,
        message: &async_nats::jetstream::Message,
        dead: &DeadLetter,
    ) -> Result<(), BoxError> {
        let mut headers = message.headers.clone().unwrap_or_default();
        // The dead letter's own id, the same each time this message is dead-lettered (so
        // JetStream drops a repeat) and never the message's (which JetStream, if the same
        // stream holds the dead letters, would drop as a duplicate of the message itself).
        let original = headers.get(MSG_ID).map(|id| id.as_str().to_owned());
        let id = match (&original, message.info()) {
            (Some(id), _) => format!("{id}:dead-letter"),
            (None, Ok(info)) => format!("{}:{}:dead-letter", info.stream, info.stream_sequence),
            (None, Err(_)) => format!("{}:dead-letter", message.subject),
        };
        headers.insert(MSG_ID, id.as_str());
        if let Some(original) = &original {
            headers.insert(super::MESSAGE_ID.as_str(), original.as_str());
        }
        headers.insert("safe-retry-reason", dead.reason);
        headers.insert("safe-retry-detail", one_line(&dead.detail).as_str());
        headers.insert("safe-retry-subject", message.subject.as_str());
        self.context
            .publish_with_headers(self.dead_letters.clone(), headers, message.payload.clone())
            .await?
            .await?;
        Ok(())
    }
}

/// A header value of `text`: NATS headers are lines.
fn one_line(text: &str) -> String {
    text.replace(['\r', '\n'], " ")
}

/// A JetStream message as the consumer front takes it.
fn delivery_of(message: &async_nats::jetstream::Message) -> Delivery {
    let mut delivery = Delivery::new(message.subject.as_str(), message.payload.clone());
    if let Some(headers) = &message.headers {
        for (name, values) in headers.iter() {
            let name: &str = name.as_ref();
            if name.eq_ignore_ascii_case(MSG_ID) {
                if let Some(id) = values.first() {
                    delivery = delivery.id(id.as_str());
                }
                continue;
            }
            for value in values {
                delivery = delivery.header(name, value.as_str().as_bytes());
            }
        }
    }
    delivery
}
