//! The relay's HTTP deliveries: through this workspace's client, the key its
//! `Idempotency-Key`.

use http::StatusCode;
use reqwest_middleware::ClientWithMiddleware;
use reqwest_safe_retry::NaturalKey;

use super::Published;
use crate::outgoing::{NO_MIDDLEWARE, Verdict, sent_with_key, verdict};
use crate::store::OutboxMessage;

/// Sends `message` through `client`, with the key derived from its id.
pub(super) async fn publish(client: &ClientWithMiddleware, message: &OutboxMessage) -> Published {
    let Ok(method) = http::Method::from_bytes(message.method.as_bytes()) else {
        return Published::Refused {
            status: None,
            error: format!("`{}` is not an HTTP method", message.method),
        };
    };
    let mut request = client
        .request(method, &message.url)
        .with_extension(NaturalKey::new(message.id.clone()))
        .body(message.body.clone());
    for (name, value) in &message.headers {
        request = request.header(name, value);
    }
    match request.send().await {
        // A client without this workspace's middleware sent it without a key: kept pending
        // (and said so) until the relay is given the right client.
        Ok(response) if !sent_with_key(&response) => Published::Transient(NO_MIDDLEWARE.to_owned()),
        answer => outcome(answer.map(|r| r.status())),
    }
}

/// What a receiver's answer (or its absence) makes of a delivery.
pub(super) fn outcome(answer: Result<StatusCode, reqwest_middleware::Error>) -> Published {
    match answer {
        Ok(status) => match verdict(status) {
            Verdict::Done => Published::Sent(status.as_u16()),
            Verdict::Refused => Published::Refused {
                status: Some(status.as_u16()),
                error: format!("the receiver refused the message with {status}"),
            },
            Verdict::Transient => {
                Published::Answered(status.as_u16(), format!("the receiver answered {status}"))
            }
        },
        Err(error) => Published::Transient(error.to_string()),
    }
}
