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

/// The mark of a head whose status a layer is told not to store: not an outcome.
pub(crate) fn not_stored(statuses: &[http::StatusCode], head: &Head) -> Option<Mark> {
    statuses.contains(&head.status).then_some(Mark::Unfinished)
}

/// What an answer is, by the marks every transport carries in its extensions and the
/// front's own reading of its head, in this order: a fenced step, then not an outcome (the
/// `Unfinished` marker, then what the front is told not to store), then a rejection.
pub(crate) fn mark_of(front: &dyn Front, head: &mut Head) -> Option<Mark> {
    let extensions = &head.extensions;
    if extensions.get::<crate::markers::FencedStep>().is_some() {
        return Some(Mark::Fenced);
    }
    if extensions.get::<crate::markers::Unfinished>().is_some() {
        return Some(Mark::Unfinished);
    }
    let rejected = extensions.get::<crate::markers::Rejected>().is_some();
    match front.mark(head) {
        None if rejected => Some(Mark::Rejected),
        mark => mark,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A front that is told not to store `503`s.
    struct NotStored503;

    impl Front for NotStored503 {
        fn own(&self, problem: Problem, detail: &str, _: Option<Duration>) -> Response<Bytes> {
            problem.response(detail)
        }
        fn mark(&self, head: &mut Head) -> Option<Mark> {
            (head.status == 503).then_some(Mark::Unfinished)
        }
        fn stored(&self, head: &Head, _: Option<&Bytes>, _: Option<&HeaderMap>) -> StoredAnswer {
            StoredAnswer {
                status: head.status,
                headers: Vec::new(),
                body: None,
            }
        }
        fn replay(&self, _: &StoredAnswer, _: bool) -> Response<Whole> {
            Response::new(Whole::default())
        }
    }

    #[test]
    fn a_fenced_step_comes_first_then_not_an_outcome_then_a_rejection() {
        let head = |status: u16, marks: &dyn Fn(&mut http::Extensions)| {
            let mut response = Response::new(());
            *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
            marks(response.extensions_mut());
            response.into_parts().0
        };
        let front = NotStored503;
        type Marks<'a> = &'a dyn Fn(&mut http::Extensions);
        let cases: [(u16, Marks, Option<Mark>); 6] = [
            (200, &|_| {}, None),
            (503, &|_| {}, Some(Mark::Unfinished)),
            (
                200,
                &|e| {
                    e.insert(crate::markers::Rejected);
                },
                Some(Mark::Rejected),
            ),
            (
                503,
                &|e| {
                    e.insert(crate::markers::Rejected);
                },
                Some(Mark::Unfinished),
            ),
            (
                200,
                &|e| {
                    e.insert(crate::markers::Rejected);
                    e.insert(crate::markers::Unfinished);
                },
                Some(Mark::Unfinished),
            ),
            (
                503,
                &|e| {
                    e.insert(crate::markers::Unfinished);
                    e.insert(crate::markers::FencedStep);
                },
                Some(Mark::Fenced),
            ),
        ];
        for (i, (status, marks, expected)) in cases.into_iter().enumerate() {
            assert_eq!(
                mark_of(&front, &mut head(status, marks)),
                expected,
                "case {i}"
            );
        }
    }
}
