//! RabbitMQ's adapter (lapin): a queue's deliveries through a [`Consumer`], each acknowledged
//! only after its outcome commits, delivered again (after a wait) while it cannot finish, and
//! published to a dead-letter queue with its reason (confirmed by the broker) before it is
//! acknowledged.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Confirmation};
use tower_service::Service;

use super::{Consumer, DeadLetter, Delivery, Payload, Verdict};
use crate::body::BoxError;
use crate::store::Store;

/// Consumes a RabbitMQ queue through a [`Consumer`] (feature `rabbitmq`).
///
/// - The message's id is its `message_id` property (publishers set it once for every copy;
///   this crate's outbox relay sets it to the message's derived key). Its headers of text
///   (long strings) reach the handler as HTTP headers, its content type as `content-type`.
/// - [`Verdict::Ack`]: acknowledged, after the outcome committed.
/// - [`Verdict::Retry`]: held unacknowledged for the wait, then rejected with `requeue`, so
///   the broker delivers it again (to this consumer or another).
/// - [`Verdict::DeadLetter`]: published to the dead-letter queue through the default exchange
///   (same payload and properties, with `safe-retry-reason`, `safe-retry-detail` and
///   `safe-retry-queue` headers), and acknowledged once the broker confirms it; if the broker
///   does not, the message is delivered again and dead-lettered then.
///
/// A consumer that dies with deliveries unacknowledged (a crash, a kill, a closed channel) has
/// them delivered again by the broker; each then finds its outcome stored and is acknowledged
/// without its effect, or runs from its last recovery point.
#[derive(Debug, Clone)]
pub struct RabbitMq {
    channel: Channel,
    queue: String,
    dead_letters: String,
    prefetch: u16,
    tag: String,
}

/// The header of a dead letter that names its reason.
const REASON: &str = "safe-retry-reason";
/// The header of a dead letter that says what happened.
const DETAIL: &str = "safe-retry-detail";
/// The header of a dead letter that names the queue it came from.
const QUEUE: &str = "safe-retry-queue";

impl RabbitMq {
    /// Consumes `queue` on `channel` (the queue must exist). Dead letters go to
    /// `<queue>.dead-letters`, declared durable when the consumer starts.
    pub fn new(channel: Channel, queue: impl Into<String>) -> RabbitMq {
        let queue = queue.into();
        RabbitMq {
            dead_letters: format!("{queue}.dead-letters"),
            channel,
            queue,
            prefetch: 16,
            tag: String::new(),
        }
    }

    /// The queue dead letters go to (declared durable when the consumer starts).
    pub fn dead_letters(mut self, queue: impl Into<String>) -> RabbitMq {
        self.dead_letters = queue.into();
        self
    }

    /// How many deliveries this consumer holds unacknowledged, and processes at once \[16\].
    pub fn prefetch(mut self, prefetch: u16) -> RabbitMq {
        self.prefetch = prefetch.max(1);
        self
    }

    /// The consumer's tag [chosen by the broker].
    pub fn tag(mut self, tag: impl Into<String>) -> RabbitMq {
        self.tag = tag.into();
        self
    }

    /// Consumes until the channel closes or the consumer is cancelled (then `Ok`), or the
    /// broker fails (then its error). Deliveries are processed concurrently, up to the
    /// prefetch. To stop, close the channel or abort the task: what was not acknowledged is
    /// delivered again.
    pub async fn run<Svc, S, R>(self, consumer: Consumer<Svc, S>) -> Result<(), lapin::Error>
    where
        Svc: Service<Request<Payload>, Response = Response<R>> + Clone + Send + Sync + 'static,
        Svc::Future: Send,
        Svc::Error: Send,
        S: Store,
        R: Body<Data = Bytes> + Unpin + Send + 'static,
        R::Error: Into<BoxError>,
    {
        let channel = &self.channel;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(
                self.dead_letters.as_str().into(),
                durable,
                FieldTable::default(),
            )
            .await?;
        let mut deliveries = channel
            .basic_consume(
                self.queue.as_str().into(),
                self.tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut running = tokio::task::JoinSet::new();
        let ended = loop {
            let next = tokio::select! {
                next = super::next(&mut deliveries) => next,
                Some(_) = running.join_next(), if !running.is_empty() => continue,
            };
            match next {
                None => break Ok(()),
                Some(Err(error)) => break Err(error),
                Some(Ok(delivery)) => {
                    let (adapter, consumer) = (self.clone(), consumer.clone());
                    running.spawn(async move { adapter.process(&consumer, delivery).await });
                }
            }
        };
        while running.join_next().await.is_some() {}
        ended
    }

    /// One delivery: processed, then settled with the broker. A settlement the broker does not
    /// take (a closed channel) leaves the message for its redelivery.
    async fn process<Svc, S, R>(
        &self,
        consumer: &Consumer<Svc, S>,
        delivery: lapin::message::Delivery,
    ) where
        Svc: Service<Request<Payload>, Response = Response<R>> + Clone + Send + 'static,
        Svc::Future: Send,
        Svc::Error: Send,
        S: Store,
        R: Body<Data = Bytes> + Unpin + Send + 'static,
        R::Error: Into<BoxError>,
    {
        let verdict = consumer.handle(delivery_of(&self.queue, &delivery)).await;
        let _ = match verdict {
            Verdict::Ack => delivery.acker.ack(BasicAckOptions::default()).await,
            Verdict::Retry { after } => self.requeue(&delivery, after).await,
            Verdict::DeadLetter(dead) => match self.dead_letter(&delivery, &dead).await {
                Ok(true) => delivery.acker.ack(BasicAckOptions::default()).await,
                Ok(false) | Err(_) => self.requeue(&delivery, Duration::from_secs(1)).await,
            },
        };
    }

    async fn requeue(
        &self,
        delivery: &lapin::message::Delivery,
        after: Duration,
    ) -> Result<bool, lapin::Error> {
        tokio::time::sleep(after).await;
        let requeue = BasicNackOptions {
            multiple: false,
            requeue: true,
        };
        delivery.acker.nack(requeue).await
    }

    /// Publishes the dead letter and waits for the broker's confirmation: `Ok(true)` once it
    /// holds it.
    async fn dead_letter(
        &self,
        delivery: &lapin::message::Delivery,
        dead: &DeadLetter,
    ) -> Result<bool, lapin::Error> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
        headers.insert(REASON.into(), text(dead.reason));
        headers.insert(DETAIL.into(), text(&dead.detail));
        headers.insert(QUEUE.into(), text(&self.queue));
        let properties = delivery.properties.clone().with_headers(headers);
        let confirm = self
            .channel
            .basic_publish(
                ShortString::from(""),
                self.dead_letters.as_str().into(),
                BasicPublishOptions::default(),
                &delivery.data,
                properties,
            )
            .await?
            .await?;
        Ok(matches!(confirm, Confirmation::Ack(None)))
    }
}

/// A RabbitMQ delivery as the consumer front takes it.
fn delivery_of(queue: &str, delivery: &lapin::message::Delivery) -> Delivery {
    let mut message = Delivery::new(queue, Bytes::copy_from_slice(&delivery.data));
    if let Some(id) = delivery.properties.message_id() {
        message = message.id(id.as_str());
    }
    if let Some(headers) = delivery.properties.headers() {
        for (name, value) in headers {
            // RabbitMQ's tables carry text as long strings (it reads `s` as a short integer).
            if let AMQPValue::LongString(s) = value {
                message = message.header(name.as_str(), s.as_bytes());
            }
        }
    }
    if let Some(kind) = delivery.properties.content_type() {
        message = message.header("content-type", kind.as_str().as_bytes());
    }
    message
}
