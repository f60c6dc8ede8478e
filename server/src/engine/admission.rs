//! Admission: what a guarded request must bring before it may claim a record — a well-formed
//! key, a caller to scope it to, and a body read whole, within its size and its time.

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::body::{BoxError, ReplyBody};
use crate::config::Config;
use crate::problem::Problem;
use crate::store::Store;

use super::Asked;
use super::answers::refuse;

/// A request admitted to the claim.
pub(crate) struct Admitted {
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
    pub(crate) scope: String,
    pub(crate) key: String,
    pub(crate) fingerprint: [u8; 32],
}

/// What admission decided.
pub(crate) enum Admission<B, R> {
    /// On to the claim.
    Admitted(Admitted),
    /// No key where none is required: straight to the handler, nothing recorded.
    Pass(Request<B>),
    /// Refused (`400`, `401`, `408`, `413`): nothing ran and nothing is stored.
    Refused(Response<ReplyBody<R>>),
}

/// Reads what the claim needs. A key that does not need the body is read first, so a request
/// without one is answered (or passed through) before its body is read.
pub(crate) async fn admit<S, B, R>(
    config: &Config<S>,
    request: Request<B>,
    asked: Asked<B>,
) -> Admission<B, R>
where
    S: Store,
    B: Body,
    B::Error: Into<BoxError>,
{
    let refused = |(problem, detail): Refusal| Admission::Refused(refuse(config, problem, &detail));
    let (parts, body) = request.into_parts();
    let mut key = None;
    if !config.key.needs_body() {
        match read_key(config, &parts, &Bytes::new(), asked.key_required) {
            Err(refusal) => return refused(refusal),
            Ok(None) => return Admission::Pass(Request::from_parts(parts, body)),
            Ok(Some(found)) => key = Some(found),
        }
    }
    let Some(scope) = config.scope.of(&parts) else {
        let detail = "no caller to scope the idempotency key to";
        return refused((Problem::NoScope, detail.into()));
    };
    let body = match read_body(config, body).await {
        Ok(body) => body,
        Err(refusal) => return refused(refusal),
    };
    let key = match key {
        Some(key) => key,
        None => match read_key(config, &parts, &body, asked.key_required) {
            Err(refusal) => return refused(refusal),
            Ok(None) => return Admission::Pass(Request::from_parts(parts, (asked.rebody)(body))),
            Ok(Some(key)) => key,
        },
    };
    let fingerprint = config
        .front
        .fingerprint(config.fingerprint.of(&parts, &body));
    Admission::Admitted(Admitted {
        parts,
        body,
        scope,
        key,
        fingerprint,
    })
}

/// Why a request is refused, and the detail its problem says.
type Refusal = (Problem, String);

/// The key: `Ok(None)` when the request has none and none is required.
fn read_key<S>(
    config: &Config<S>,
    parts: &Parts,
    body: &Bytes,
    required: bool,
) -> Result<Option<String>, Refusal> {
    match config.key.read(parts, body, config.max_key_len) {
        Err(error) => Err((Problem::MalformedKey, error.to_string())),
        Ok(None) if required => Err((
            Problem::MissingKey,
            "this route requires an idempotency key".into(),
        )),
        Ok(key) => Ok(key),
    }
}

/// The body, whole: at most `max_request_body` bytes, within `request_body_timeout`.
async fn read_body<S, B>(config: &Config<S>, body: B) -> Result<Bytes, Refusal>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let reading = Limited::new(body, config.max_request_body).collect();
    match tokio::time::timeout(config.request_body_timeout, reading).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(error)) if error.downcast_ref::<LengthLimitError>().is_some() => {
            let detail = format!(
                "the request body is over {} bytes; nothing was done",
                config.max_request_body
            );
            Err((Problem::BodyTooLarge, detail))
        }
        Ok(Err(error)) => Err((Problem::BodyUnreadable, error.to_string())),
        Err(_) => {
            let detail = format!(
                "the request body did not arrive whole within {:?}; nothing was done",
                config.request_body_timeout
            );
            Err((Problem::BodyTimeout, detail))
        }
    }
}
