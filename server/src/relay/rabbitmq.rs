//! The relay's RabbitMQ publishes: `message_id` the message's key, published `mandatory` on a
//! channel in confirm mode; sent once the broker confirms it and returned none.
//!
//! One publish at a time on the channel, its confirmation read before the next: lapin hands a
//! returned message to whichever confirmation it reads next, not to the publish it came from,
//! and the broker may confirm out of order, so two publishes in flight on one channel could
//! swap their returns (a message no queue took counted sent, and lost). The publish and the
//! read of its confirmation run in a task of their own, so a relay stopped between the two
//! leaves no confirmation unread for the next publish to take.

use std::sync::Arc;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation};
use tokio::sync::{Mutex, OnceCell};

use super::Published;
use crate::store::OutboxMessage;

/// A channel, put in confirm mode before its first publish, with one publish on it at a time.
#[derive(Clone)]
pub(crate) struct Publisher {
    channel: Channel,
    confirming: Arc<OnceCell<()>>,
    turn: Arc<Mutex<()>>,
}

impl Publisher {
    pub(crate) fn new(channel: Channel) -> Publisher {
        Publisher {
            channel,
            confirming: Arc::new(OnceCell::new()),
            turn: Arc::new(Mutex::new(())),
        }
    }

    /// Publishes `message` to `exchange` with `routing_key` and waits for the broker's
    /// confirmation.
    pub(crate) async fn publish(
        &self,
        message: &OutboxMessage,
        exchange: &str,
        routing_key: &str,
    ) -> Published {
        // Waiting for the turn may be cut short; once it is taken, the publish and the read of
        // its confirmation finish whatever becomes of the relay.
        let turn = Arc::clone(&self.turn).lock_owned().await;
        let publishing = tokio::spawn({
            let publisher = self.clone();
            let message = message.clone();
            let (exchange, routing_key) = (exchange.to_owned(), routing_key.to_owned());
            async move {
                let confirmed = publisher.confirmed(&message, &exchange, &routing_key).await;
                drop(turn);
                confirmed
            }
        });
        let confirmed = match publishing.await {
            Ok(confirmed) => confirmed,
            Err(error) => return Published::Transient(format!("the publish did not end: {error}")),
        };
        match confirmed {
            Ok(Confirmation::Ack(None)) => Published::Sent(0),
            Ok(Confirmation::Ack(Some(_))) => Published::Transient(format!(
                "no queue is bound to exchange `{exchange}` for routing key `{routing_key}`: the broker returned the message"
            )),
            Ok(Confirmation::Nack(_)) => {
                Published::Transient("the broker did not take the message (nack)".into())
            }
            Ok(Confirmation::NotRequested) => {
                Published::Transient("the channel is not in confirm mode".into())
            }
            Err(error) => Published::Transient(format!("RabbitMQ: {error}")),
        }
    }

    async fn confirmed(
        &self,
        message: &OutboxMessage,
        exchange: &str,
        routing_key: &str,
    ) -> Result<Confirmation, lapin::Error> {
        self.confirming
            .get_or_try_init(|| async {
                self.channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await
            })
            .await?;
        let mut headers = FieldTable::default();
        let mut properties = BasicProperties::default()
            .with_message_id(message.id.as_str().into())
            .with_delivery_mode(2);
        for (name, value) in &message.headers {
            if name == http::header::CONTENT_TYPE {
                if let Ok(kind) = value.to_str() {
                    properties = properties.with_content_type(kind.into());
                }
                continue;
            }
            headers.insert(
                name.as_str().into(),
                AMQPValue::LongString(LongString::from(value.as_bytes().to_vec())),
            );
        }
        let properties = properties.with_headers(headers);
        let mandatory = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        self.channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                mandatory,
                &message.body,
                properties,
            )
            .await?
            .await
    }
}
