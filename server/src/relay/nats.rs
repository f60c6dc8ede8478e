//! The relay's JetStream publishes: `Nats-Msg-Id` the message's key, so the stream's duplicate
//! window drops a publish made again; sent once JetStream acknowledges it.

use async_nats::HeaderMap;
use async_nats::jetstream::Context;

use super::Published;
use crate::store::OutboxMessage;

/// Publishes `message` to `subject` and waits for JetStream's acknowledgement.
pub(super) async fn publish(
    context: &Context,
    message: &OutboxMessage,
    subject: &str,
) -> Published {
    let mut headers = HeaderMap::new();
    for (name, value) in &message.headers {
        if let Ok(value) = value.to_str() {
            headers.append(name.as_str(), value);
        }
    }
    headers.insert("Nats-Msg-Id", message.id.as_str());
    let sent = async {
        context
            .publish_with_headers(subject.to_owned(), headers, message.body.clone())
            .await?
            .await
            .map_err(crate::body::BoxError::from)
    };
    match sent.await {
        Ok(_) => Published::Sent(0),
        Err(error) => Published::Transient(format!("JetStream did not take the message: {error}")),
    }
}
