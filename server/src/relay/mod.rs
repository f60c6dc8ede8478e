//! The outbox relay: delivers staged messages at least once — to HTTP receivers through this
//! workspace's client, to RabbitMQ with publisher confirms, to NATS JetStream with
//! `Nats-Msg-Id` — each under a key derived from the message's id.

#[cfg(feature = "client")]
mod http;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;

use std::fmt;
use std::time::Duration;

use crate::events::{Event, EventLevels, emit};
use crate::store::{Outbox, OutboxMessage, Settle, StoreError};

/// Delivers the outbox's messages: each at least once after the transaction that staged it
/// commits, under a key derived from the message's id, so that a delivery made again (a relay
/// that died before marking it sent) is the same message to the receiver:
///
/// - an HTTP message ([`Message::post`](crate::Message::post)) through a `reqwest-safe-retry`
///   client ([`http`](Relay::http); its backoff, budget and deadline within a delivery), the
///   key its `Idempotency-Key`;
/// - a RabbitMQ message ([`Message::rabbitmq`](crate::Message::rabbitmq)) on a channel
///   ([`rabbitmq`](Relay::rabbitmq), feature `rabbitmq`), the key its `message_id`, sent
///   once the broker confirms it (publisher confirms; published `mandatory`, so a message no
///   queue takes is not sent);
/// - a JetStream message ([`Message::nats`](crate::Message::nats)) through a JetStream
///   context ([`nats`](Relay::nats), feature `nats`), the key its `Nats-Msg-Id`, so the
///   stream's duplicate window drops a publish made again; sent once JetStream acknowledges it.
///
/// A message for a destination this relay has not been given stays pending, and says so.
///
/// For HTTP, a `2xx` marks the message sent. A `3xx`, or a `4xx` other than `408`, `409`, `425` and
/// `429`, marks it failed: the receiver refused it, and sending it again would not change that
/// (a step's call reads a status the same way). Anything else (no answer, `5xx`, those four)
/// leaves it pending, due again after
/// [`retry_after`](Relay::retry_after), until it has been taken
/// [`max_deliveries`](Relay::max_deliveries) times.
///
/// Safe to run on every server: a message is taken by one relay at a time (for
/// [`lease`](Relay::lease)), and a relay settles only what it took.
#[derive(Clone)]
pub struct Relay<S> {
    store: S,
    #[cfg(feature = "client")]
    http: Option<reqwest_middleware::ClientWithMiddleware>,
    #[cfg(feature = "rabbitmq")]
    rabbitmq: Option<rabbitmq::Publisher>,
    #[cfg(feature = "nats")]
    nats: Option<async_nats::jetstream::Context>,
    batch: u32,
    lease: Duration,
    retry_after: Duration,
    max_deliveries: i64,
    keep_sent: Duration,
    keep_failed: Duration,
}

impl<S> fmt::Debug for Relay<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("batch", &self.batch)
            .field("lease", &self.lease)
            .field("retry_after", &self.retry_after)
            .field("max_deliveries", &self.max_deliveries)
            .field("keep_sent", &self.keep_sent)
            .field("keep_failed", &self.keep_failed)
            .finish_non_exhaustive()
    }
}

/// What one [`tick`](Relay::tick) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// Messages taken.
    pub taken: usize,
    /// Delivered: the receiver answered `2xx`, or the broker confirmed it.
    pub sent: usize,
    /// Not delivered this time; due again later.
    pub retrying: usize,
    /// Refused by the receiver, or out of deliveries: marked failed.
    pub failed: usize,
    /// Delivered or not, but another relay took the message meanwhile (this relay's lease ran
    /// out): its settlement is that relay's.
    pub lost: usize,
    /// Delivered or not, but the store failed to record it: due again after the lease.
    pub store_failures: usize,
}

impl<S: Outbox> Relay<S> {
    /// A relay of `store`'s HTTP messages through `client`: build the client with this
    /// workspace's middleware, whose policy (attempts, backoff, deadline, budget) governs each
    /// delivery. The same as `Relay::of(store).http(client)`.
    #[cfg(feature = "client")]
    #[cfg_attr(docsrs, doc(cfg(feature = "client")))]
    pub fn new(store: S, client: reqwest_middleware::ClientWithMiddleware) -> Relay<S> {
        Relay::of(store).http(client)
    }

    /// A relay of `store`'s outbox with no destination yet: give it the ones its messages go
    /// to ([`http`](Relay::http), [`rabbitmq`](Relay::rabbitmq), [`nats`](Relay::nats)).
    pub fn of(store: S) -> Relay<S> {
        Relay {
            store,
            #[cfg(feature = "client")]
            http: None,
            #[cfg(feature = "rabbitmq")]
            rabbitmq: None,
            #[cfg(feature = "nats")]
            nats: None,
            batch: 32,
            lease: Duration::from_secs(60),
            retry_after: Duration::from_secs(5),
            max_deliveries: 20,
            keep_sent: Duration::from_secs(24 * 60 * 60),
            keep_failed: Duration::from_secs(7 * 24 * 60 * 60),
        }
    }

    /// Delivers HTTP messages through `client` (built with this workspace's middleware, which
    /// sets the key).
    #[cfg(feature = "client")]
    #[cfg_attr(docsrs, doc(cfg(feature = "client")))]
    pub fn http(mut self, client: reqwest_middleware::ClientWithMiddleware) -> Self {
        self.http = Some(client);
        self
    }

    /// Publishes RabbitMQ messages on `channel`, which the relay puts in confirm mode. One
    /// publish at a time on it, each waiting for its confirmation: that is what ties a message
    /// the broker returns (no queue bound) to the publish it came from. Give the relay a
    /// channel of its own; its rate is one broker round trip a message.
    #[cfg(feature = "rabbitmq")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
    pub fn rabbitmq(mut self, channel: lapin::Channel) -> Self {
        self.rabbitmq = Some(rabbitmq::Publisher::new(channel));
        self
    }

    /// Publishes JetStream messages through `context`.
    #[cfg(feature = "nats")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    pub fn nats(mut self, context: async_nats::jetstream::Context) -> Self {
        self.nats = Some(context);
        self
    }

    /// How many messages one tick takes at most, and delivers concurrently \[32\].
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long a relay holds a message it took [60 s]: keep it above the client's total
    /// deadline, or a slow delivery may be made again by another relay meanwhile (harmless to
    /// a receiver that dedupes on the key, but wasted).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The wait before a message that was not delivered is due again [5 s].
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// How many times a message is taken before it is marked failed \[20\].
    pub fn max_deliveries(mut self, deliveries: u32) -> Self {
        self.max_deliveries = i64::from(deliveries.max(1));
        self
    }

    /// How long a sent message's row is kept before the sweep deletes it [24 h].
    pub fn keep_sent(mut self, keep: Duration) -> Self {
        self.keep_sent = keep;
        self
    }

    /// How long a failed message's row is kept before the sweep deletes it [7 days].
    pub fn keep_failed(mut self, keep: Duration) -> Self {
        self.keep_failed = keep;
        self
    }

    /// Takes up to a batch of due messages and delivers them, concurrently. A tick that reports
    /// `taken` equal to the batch left more behind: tick again.
    pub async fn tick(&self) -> Result<RelayReport, StoreError> {
        let taken = self.store.take_messages(self.batch, self.lease).await?;
        let mut report = RelayReport {
            taken: taken.len(),
            ..RelayReport::default()
        };
        let levels = EventLevels::default();
        let mut running = tokio::task::JoinSet::new();
        for message in taken {
            let relay = self.clone();
            running.spawn(async move { relay.deliver(message).await });
        }
        while let Some(done) = running.join_next().await {
            match done {
                Ok(Ok((settle, true))) => match settle {
                    Settle::Sent { .. } => report.sent += 1,
                    Settle::Retry { .. } => report.retrying += 1,
                    Settle::Failed { .. } => report.failed += 1,
                },
                Ok(Ok((_, false))) => report.lost += 1,
                // Delivered or not, its settlement was not written: it is due again after the
                // lease, and delivered again under its key.
                Ok(Err(error)) => {
                    report.store_failures += 1;
                    emit!(levels, Event::WorkerFailed, worker = "relay", error = %error);
                }
                // A delivery that panicked is due again after the lease.
                Err(_) => report.retrying += 1,
            }
        }
        if report.taken > 0 {
            let r = report;
            emit!(
                levels,
                Event::Relayed,
                taken = r.taken,
                sent = r.sent,
                retrying = r.retrying,
                failed = r.failed,
                lost = r.lost,
                store_failures = r.store_failures
            );
        }
        Ok(report)
    }

    /// Ticks every `every`, for ever (a tick that fills its batch is followed by another at
    /// once). Store failures are logged and the next tick tries again. Spawn it on tokio and
    /// abort the task to stop it.
    pub async fn run(self, every: Duration) {
        let batch = self.batch as usize;
        crate::worker::tick_every(every, batch, "relay", || async {
            self.tick().await.map(|report| report.taken)
        })
        .await
    }

    async fn deliver(&self, message: OutboxMessage) -> Result<(Settle, bool), StoreError> {
        let published = self.publish(&message).await;
        let settle = self.settlement(&message, published);
        let settled = self
            .store
            .settle(&message.id, message.delivery, &settle)
            .await?;
        let levels = EventLevels::default();
        let (id, delivery) = (&message.id, message.delivery);
        match &settle {
            Settle::Sent { status, .. } => {
                emit!(levels, Event::Delivered, id = %id, delivery, status, settled);
            }
            Settle::Retry { error, .. } => {
                emit!(levels, Event::DeliveryRetry, id = %id, delivery, error, settled);
            }
            Settle::Failed { error, .. } => {
                emit!(levels, Event::DeliveryFailed, id = %id, delivery, error, settled);
            }
        }
        Ok((settle, settled))
    }

    /// Sends the message to its destination, by the destination's kind.
    async fn publish(&self, message: &OutboxMessage) -> Published {
        match Destination::of(&message.url) {
            Destination::RabbitMq {
                exchange,
                routing_key,
            } => {
                #[cfg(feature = "rabbitmq")]
                if let Some(publisher) = &self.rabbitmq {
                    return publisher.publish(message, &exchange, routing_key).await;
                }
                let _ = (exchange, routing_key);
                Published::Transient("this relay has no RabbitMQ channel: give it one with `Relay::rabbitmq` (feature `rabbitmq`)".into())
            }
            Destination::Nats { subject } => {
                #[cfg(feature = "nats")]
                if let Some(context) = &self.nats {
                    return nats::publish(context, message, subject).await;
                }
                let _ = subject;
                Published::Transient("this relay has no JetStream context: give it one with `Relay::nats` (feature `nats`)".into())
            }
            Destination::Http => {
                #[cfg(feature = "client")]
                if let Some(client) = &self.http {
                    return http::publish(client, message).await;
                }
                Published::Transient("this relay has no HTTP client: give it one with `Relay::http` (feature `client`)".into())
            }
        }
    }

    fn settlement(&self, message: &OutboxMessage, published: Published) -> Settle {
        match published {
            Published::Sent(status) => Settle::Sent {
                status,
                keep: self.keep_sent,
            },
            Published::Refused { status, error } => Settle::Failed {
                status,
                error,
                keep: self.keep_failed,
            },
            Published::Transient(error) if message.delivery >= self.max_deliveries => {
                Settle::Failed {
                    status: None,
                    error: format!("{error}; gave up after {} deliveries", message.delivery),
                    keep: self.keep_failed,
                }
            }
            Published::Transient(error) => Settle::Retry {
                after: self.retry_after,
                error,
            },
            Published::Answered(status, error) if message.delivery >= self.max_deliveries => {
                Settle::Failed {
                    status: Some(status),
                    error: format!("{error}; gave up after {} deliveries", message.delivery),
                    keep: self.keep_failed,
                }
            }
            Published::Answered(_, error) => Settle::Retry {
                after: self.retry_after,
                error,
            },
        }
    }
}

/// What became of one delivery, whatever its destination.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Published {
    /// Delivered: the receiver's `2xx`, or `0` for a broker's confirmation.
    Sent(u16),
    /// The receiver refused it; sending it again would not change that.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    Refused { status: Option<u16>, error: String },
    /// Not delivered this time, and no status to keep.
    Transient(String),
    /// Not delivered this time; the receiver answered this status.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    Answered(u16, String),
}

/// Where a staged message goes, by its URL: `rabbitmq:<exchange>/<routing key>` (the
/// exchange with `%2F` for `/` and `%25` for `%`), `nats:<subject>`, or an HTTP URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Destination<'a> {
    RabbitMq {
        exchange: String,
        routing_key: &'a str,
    },
    Nats {
        subject: &'a str,
    },
    Http,
}

impl<'a> Destination<'a> {
    pub(crate) fn of(url: &'a str) -> Destination<'a> {
        if let Some(rest) = url.strip_prefix(RABBITMQ) {
            let (exchange, routing_key) = rest.split_once('/').unwrap_or((rest, ""));
            Destination::RabbitMq {
                exchange: exchange.replace("%2F", "/").replace("%25", "%"),
                routing_key,
            }
        } else if let Some(subject) = url.strip_prefix(NATS) {
            Destination::Nats { subject }
        } else {
            Destination::Http
        }
    }
}

/// The scheme of a staged RabbitMQ message's URL.
pub(crate) const RABBITMQ: &str = "rabbitmq:";
/// The scheme of a staged JetStream message's URL.
pub(crate) const NATS: &str = "nats:";

#[cfg(all(test, feature = "sqlite", feature = "client"))]
mod tests {
    use super::*;
    use crate::store::SqliteStore;
    use ::http::StatusCode;

    async fn relay() -> Relay<SqliteStore> {
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new()).build();
        Relay::new(SqliteStore::memory().await.unwrap(), client)
            .max_deliveries(3)
            .retry_after(Duration::from_millis(7))
            .keep_sent(Duration::from_secs(11))
            .keep_failed(Duration::from_secs(13))
    }

    fn message(delivery: i64) -> OutboxMessage {
        OutboxMessage {
            id: "m".into(),
            method: "POST".into(),
            url: "http://127.0.0.1:1/".into(),
            headers: Vec::new(),
            body: bytes::Bytes::new(),
            delivery,
        }
    }

    fn status(code: u16) -> Published {
        http::outcome(Ok(StatusCode::from_u16(code).unwrap()))
    }

    #[tokio::test]
    async fn a_2xx_is_sent_a_refusal_failed_and_the_rest_tried_again_until_the_last_delivery() {
        let relay = relay().await;
        assert_eq!(
            relay.settlement(&message(1), status(202)),
            Settle::Sent {
                status: 202,
                keep: Duration::from_secs(11)
            }
        );
        for refused in [301, 400, 404, 410, 422] {
            assert_eq!(
                relay.settlement(&message(1), status(refused)),
                Settle::Failed {
                    status: Some(refused),
                    error: format!(
                        "the receiver refused the message with {}",
                        StatusCode::from_u16(refused).unwrap()
                    ),
                    keep: Duration::from_secs(13)
                }
            );
        }
        for transient in [408, 409, 425, 429, 500, 503] {
            assert_eq!(
                relay.settlement(&message(2), status(transient)),
                Settle::Retry {
                    after: Duration::from_millis(7),
                    error: format!(
                        "the receiver answered {}",
                        StatusCode::from_u16(transient).unwrap()
                    )
                },
                "{transient}"
            );
            match relay.settlement(&message(3), status(transient)) {
                Settle::Failed {
                    status,
                    error,
                    keep,
                } => {
                    assert_eq!(status, Some(transient));
                    assert!(error.ends_with("gave up after 3 deliveries"), "{error}");
                    assert_eq!(keep, Duration::from_secs(13));
                }
                other => panic!("{other:?}"),
            }
        }
        let no_answer = || {
            http::outcome(Err(reqwest_middleware::Error::middleware(
                std::io::Error::other("connection refused"),
            )))
        };
        assert!(matches!(
            relay.settlement(&message(2), no_answer()),
            Settle::Retry { ref error, .. } if error.contains("connection refused")
        ));
        assert!(matches!(
            relay.settlement(&message(3), no_answer()),
            Settle::Failed { status: None, .. }
        ));
    }

    #[tokio::test]
    async fn a_broker_s_confirmation_is_sent_and_a_missing_destination_waits_saying_which() {
        let relay = relay().await;
        assert_eq!(
            relay.settlement(&message(1), Published::Sent(0)),
            Settle::Sent {
                status: 0,
                keep: Duration::from_secs(11)
            }
        );
        let mut nats = message(1);
        nats.url = "nats:receipts.created".into();
        match relay.settlement(&nats, relay.publish(&nats).await) {
            Settle::Retry { error, .. } => assert!(error.contains("`Relay::nats`"), "{error}"),
            other => panic!("{other:?}"),
        }
        let mut rabbit = message(3);
        rabbit.url = "rabbitmq:/q".into();
        match relay.settlement(&rabbit, relay.publish(&rabbit).await) {
            Settle::Failed { error, .. } => {
                assert!(error.contains("`Relay::rabbitmq`"), "{error}");
                assert!(error.ends_with("gave up after 3 deliveries"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        let mut bad = message(1);
        bad.method = "NOT A METHOD".into();
        assert!(matches!(
            relay.settlement(&bad, relay.publish(&bad).await),
            Settle::Failed { status: None, ref error, .. } if error.contains("is not an HTTP method")
        ));
    }

    #[test]
    fn a_message_s_destination_is_read_back_from_its_url() {
        let rabbit = crate::Message::rabbitmq("m", "ex/50%", "orders.paid/eu");
        assert_eq!(rabbit.method.as_str(), "PUBLISH");
        assert_eq!(
            Destination::of(&rabbit.url),
            Destination::RabbitMq {
                exchange: "ex/50%".into(),
                routing_key: "orders.paid/eu"
            }
        );
        let default = crate::Message::rabbitmq("m", "", "receipts");
        assert_eq!(
            Destination::of(&default.url),
            Destination::RabbitMq {
                exchange: String::new(),
                routing_key: "receipts"
            }
        );
        let nats = crate::Message::nats("m", "receipts.created");
        assert_eq!(
            Destination::of(&nats.url),
            Destination::Nats {
                subject: "receipts.created"
            }
        );
        assert_eq!(Destination::of("http://127.0.0.1:1/x"), Destination::Http);
    }
}
