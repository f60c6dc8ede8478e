//! The outbox relay: delivers staged messages at least once, through this workspace's client.

use std::fmt;
use std::time::Duration;

use http::StatusCode;
use reqwest_middleware::ClientWithMiddleware;
use reqwest_safe_retry::NaturalKey;

use crate::events::{Event, EventLevels, emit};
use crate::outgoing::{NO_MIDDLEWARE, Verdict, sent_with_key, verdict};
use crate::store::{Outbox, OutboxMessage, Settle, StoreError};

/// Delivers the outbox's messages: each at least once after the transaction that staged it
/// commits, through a `reqwest-safe-retry` client (its backoff, budget and deadline within a
/// delivery), with the idempotency key derived from the message's id, so that a delivery made
/// again (a relay that died before marking it sent) is the same request to the receiver.
///
/// A `2xx` marks the message sent. A `3xx`, or a `4xx` other than `408`, `409`, `425` and
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
    client: ClientWithMiddleware,
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
    /// Delivered: the receiver answered `2xx`.
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
    /// A relay of `store`'s outbox through `client`: build the client with this workspace's
    /// middleware, whose policy (attempts, backoff, deadline, budget) governs each delivery.
    pub fn new(store: S, client: ClientWithMiddleware) -> Relay<S> {
        Relay {
            store,
            client,
            batch: 32,
            lease: Duration::from_secs(60),
            retry_after: Duration::from_secs(5),
            max_deliveries: 20,
            keep_sent: Duration::from_secs(24 * 60 * 60),
            keep_failed: Duration::from_secs(7 * 24 * 60 * 60),
        }
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
        let settle = match http::Method::from_bytes(message.method.as_bytes()) {
            Err(_) => Settle::Failed {
                status: None,
                error: format!("`{}` is not an HTTP method", message.method),
                keep: self.keep_failed,
            },
            Ok(method) => {
                let mut request = self
                    .client
                    .request(method, &message.url)
                    .with_extension(NaturalKey::new(message.id.clone()))
                    .body(message.body.clone());
                for (name, value) in &message.headers {
                    request = request.header(name, value);
                }
                match request.send().await {
                    // A client without this workspace's middleware sent it without a key: kept
                    // pending (and said so) until the relay is given the right client.
                    Ok(response) if !sent_with_key(&response) => Settle::Retry {
                        after: self.retry_after,
                        error: NO_MIDDLEWARE.to_owned(),
                    },
                    answer => self.settlement(&message, answer.map(|r| r.status())),
                }
            }
        };
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

    fn settlement(
        &self,
        message: &OutboxMessage,
        answer: Result<StatusCode, reqwest_middleware::Error>,
    ) -> Settle {
        let retry = |error: String| {
            if message.delivery >= self.max_deliveries {
                Settle::Failed {
                    status: None,
                    error: format!("{error}; gave up after {} deliveries", message.delivery),
                    keep: self.keep_failed,
                }
            } else {
                Settle::Retry {
                    after: self.retry_after,
                    error,
                }
            }
        };
        match answer {
            Ok(status) if verdict(status) == Verdict::Done => Settle::Sent {
                status: status.as_u16(),
                keep: self.keep_sent,
            },
            Ok(status) if verdict(status) == Verdict::Refused => Settle::Failed {
                status: Some(status.as_u16()),
                error: format!("the receiver refused the message with {status}"),
                keep: self.keep_failed,
            },
            Ok(status) => match retry(format!("the receiver answered {status}")) {
                Settle::Failed { error, keep, .. } => Settle::Failed {
                    status: Some(status.as_u16()),
                    error,
                    keep,
                },
                other => other,
            },
            Err(error) => retry(error.to_string()),
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::store::SqliteStore;

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

    fn status(code: u16) -> Result<StatusCode, reqwest_middleware::Error> {
        Ok(StatusCode::from_u16(code).unwrap())
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
            Err(reqwest_middleware::Error::middleware(
                std::io::Error::other("connection refused"),
            ))
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
}
