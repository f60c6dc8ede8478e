//! How a transport speaks, as the engine asks it: the layer's own answers, what of a
//! handler's answer becomes the stored outcome, and that outcome sent again. Each front (HTTP,
//! gRPC) implements [`Front`]; the engine holds one in its configuration and never names a
//! front.

use std::time::Duration;

use bytes::Bytes;
use http::response::Parts as Head;
use http::{HeaderMap, Response};

use crate::body::Whole;
use crate::problem::Problem;
use crate::store::StoredAnswer;

/// How a transport speaks: the layer's own answers, what of a handler's answer becomes the
/// stored outcome, and that outcome sent again. The engine calls it; it never calls the
/// engine.
pub(crate) trait Front: Send + Sync + 'static {
    /// One of the layer's own answers: `problem` with `detail`, and when to ask again if the
    /// caller may.
    fn own(&self, problem: Problem, detail: &str, retry_after: Option<Duration>)
    -> Response<Bytes>;

    /// The fingerprint of an admitted request: what makes two requests the same.
    fn fingerprint(&self, config_fingerprint: [u8; 32]) -> [u8; 32] {
        config_fingerprint
    }

    /// What the handler's answer says of itself beyond its extensions (a mark a transport
    /// carries in its head, removed here), and whether its head is one the layer is told not
    /// to store.
    fn mark(&self, head: &mut Head) -> Option<Mark>;

    /// The outcome to store: the answer's head, its body when it was read whole within the
    /// limit, and its trailers.
    fn stored(
        &self,
        head: &Head,
        body: Option<&Bytes>,
        trailers: Option<&HeaderMap>,
    ) -> StoredAnswer;

    /// A stored outcome sent again, marked as a replay; `shared_scope` when it may reach
    /// another caller than the first.
    fn replay(&self, stored: &StoredAnswer, shared_scope: bool) -> Response<Whole>;
}

/// What a handler's answer is, beyond an outcome to store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    /// A step found another attempt holding the record: this holder wrote nothing.
    Fenced,
    /// Not an outcome: the record stays at its last recovery point.
    Unfinished,
    /// Refused before the handler did anything: nothing is stored.
    Rejected,
}

/// The marks every transport carries in an answer's extensions.
pub(crate) fn marked_in_extensions(head: &Head) -> Option<Mark> {
    if head
        .extensions
        .get::<crate::markers::FencedStep>()
        .is_some()
    {
        Some(Mark::Fenced)
    } else if head
        .extensions
        .get::<crate::markers::Unfinished>()
        .is_some()
    {
        Some(Mark::Unfinished)
    } else if head.extensions.get::<crate::markers::Rejected>().is_some() {
        Some(Mark::Rejected)
    } else {
        None
    }
}
