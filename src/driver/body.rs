//! Reading a response body inside the attempt, for `buffer_body(limit)`.
//!
//! A middleware returns as soon as the response head has arrived; a connection cut in the
//! middle of the body is then the caller's problem, met in `bytes()` long after any retry could
//! help. Reading the body here turns that cut into an error of the attempt, which the classifier
//! can judge like any other.
//!
//! Bodies over the limit are not held in memory: what was read so far is handed back first,
//! followed by the rest of the stream, and that response is not retried.

// In the browser no body is read inside an attempt (`Reply::READS_BODY`): what holds a part of
// one read is never made there.
#![cfg_attr(target_arch = "wasm32", allow(dead_code))]

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body::SizeHint;

use crate::error::LastError;
use crate::maybe_send::MaybeSend;
use crate::record::RetryRecord;

/// An attempt's outcome: the answer, or the error of the door beneath or the layer's own.
pub(crate) type Outcome<R> = Result<R, LastError<<R as Reply>::Error>>;

/// An answer as a door hands it to the driver: its head, its body read a chunk at a time, and
/// the same head with what the driver read of the body. A `reqwest::Response` behind the
/// reqwest door, an `http::Response` of the inner service's body behind the tower door: neither
/// is made into the other.
pub(crate) trait Reply: MaybeSend + Sized + 'static {
    /// The error the door's copies end in, and its bodies.
    type Error: crate::error::DoorError;
    /// The answer's status.
    fn status(&self) -> StatusCode;
    /// The answer's headers.
    fn headers(&self) -> &HeaderMap;
    /// The answer's headers, to change.
    fn headers_mut(&mut self) -> &mut HeaderMap;
    /// Keeps `record` where [`RetryRecord::of`] finds it: the answer's extensions (in the
    /// browser, where reqwest's answer has none, nowhere).
    fn carry(&mut self, record: RetryRecord);
    /// Whether the driver can read the answer's body inside the attempt and hand the answer
    /// back around what it read ([`chunk`](Self::chunk), [`read_whole`](Self::read_whole),
    /// [`read_first`](Self::read_first)): not in the browser, where reqwest's answer cannot be
    /// rebuilt. Without it, no body is read ([`to_read`], [`keep`]).
    const READS_BODY: bool = true;
    /// The length the body declares, if it declares one.
    fn content_length(&self) -> Option<u64>;
    /// The body's next chunk, `None` at its end; an error that cut it, as the door's attempts
    /// fail (its `failure` finds the fault in it).
    fn chunk(&mut self) -> impl Future<Output = Result<Option<Bytes>, Self::Error>> + MaybeSend;
    /// The same head with its body read whole into `body` (empty: the body dropped).
    fn read_whole(self, body: Bytes) -> Self;
    /// The same head with its body made of `read`, what was read of it already, then the rest.
    fn read_first(self, read: Prefix) -> Self;
}

/// The chunks of a body read already, handed out before the rest of it: at most two (what was
/// read within the limit, and the chunk that went over it), empty ones skipped.
#[derive(Debug, Default)]
pub(crate) struct Prefix {
    chunks: [Bytes; 2],
    next: usize,
}

impl Prefix {
    /// `read`, then `over`.
    pub(crate) fn new(read: Bytes, over: Bytes) -> Prefix {
        Prefix {
            chunks: [read, over],
            next: 0,
        }
    }

    /// The next chunk that is not empty, until none is left (a chunk handed out is left empty
    /// in its place, and passed over with the others).
    pub(crate) fn pop(&mut self) -> Option<Bytes> {
        // Bounded: two chunks.
        while self.chunks.get(self.next).is_some_and(Bytes::is_empty) {
            self.next += 1;
        }
        Some(std::mem::take(self.chunks.get_mut(self.next)?))
    }

    /// Whether every byte was handed out.
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many bytes are still to be handed out.
    pub(crate) fn len(&self) -> u64 {
        let left = self.chunks.get(self.next..).unwrap_or_default();
        left.iter().map(|chunk| chunk.len() as u64).sum()
    }

    /// A body's size hint with this prefix before it.
    pub(crate) fn before(&self, rest: SizeHint) -> SizeHint {
        let held = self.len();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower().saturating_add(held));
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(held));
        }
        hint
    }
}

/// Reads `response`'s body up to `limit` bytes.
///
/// Returns the response with its body in memory, and those bytes (shared, not copied), or,
/// when the body is longer than `limit`, a response that streams the part already read and then
/// the rest, and no bytes.
pub(crate) async fn buffer<R: Reply>(
    mut response: R,
    limit: usize,
) -> Result<(R, Option<Bytes>), R::Error> {
    let declared = response.content_length();
    if declared.is_some_and(|n| n > limit as u64) {
        return Ok((response, None));
    }
    let capacity = declared.map_or(0, |n| usize::try_from(n).unwrap_or(limit).min(limit));
    let mut read: Vec<u8> = Vec::with_capacity(capacity);
    while let Some(chunk) = response.chunk().await? {
        if read.len().saturating_add(chunk.len()) > limit {
            let streamed = response.read_first(Prefix::new(Bytes::from(read), chunk));
            return Ok((streamed, None));
        }
        read.extend_from_slice(&chunk);
    }
    let read = Bytes::from(read);
    Ok((response.read_whole(read.clone()), Some(read)))
}

/// How much of an answer's body to read inside its attempt, if any: with the policy's
/// `buffer_body` on, the body of an answer that will not be retried. A 503's body would be read in
/// full (up to the limit) only to be thrown away.
/// None when it was read already, for the classifier (`Judging::body_first`).
pub(crate) fn to_read<R: Reply>(
    judging: &crate::engine::classify::Judging<'_>,
    outcome: &Outcome<R>,
    verdict: crate::engine::classify::Verdict,
) -> Option<usize> {
    if !R::READS_BODY {
        return None;
    }
    let final_answer =
        outcome.is_ok() && matches!(verdict, crate::engine::classify::Verdict::Final(_));
    let limit = judging
        .policy
        .buffer_body_limit()
        .filter(|_| final_answer)?;
    judging.hook.is_none().then_some(limit)
}

/// How much of a transient answer's body is kept through the wait before a retry.
pub(crate) const KEPT: usize = 64 * 1024;

/// What is kept of a transient outcome through the wait before its retry (an error as it is):
/// the answer with its body read into memory, up to `limit` bytes, so that a stop after the wait (the budget, the
/// throttle, the deadline) hands the caller the server's whole answer, and the connection is
/// released rather than held while nobody reads it. A longer body, one cut off, or one still
/// arriving when `timer` fires (the wait's: a body that trickles never holds the request past
/// its wait, nor so past its deadline), is dropped, and so is the `Content-Length`
/// that promised it: the head never promises bytes that are gone.
pub(crate) async fn keep<R: Reply, T: Future<Output = ()>>(
    outcome: Outcome<R>,
    limit: usize,
    mut timer: Pin<&mut T>,
) -> Outcome<R> {
    let mut response = outcome?;
    if !R::READS_BODY {
        // Kept as it is, its body unread for the caller.
        return Ok(response);
    }
    if response.content_length().is_none_or(|n| n <= limit as u64) {
        let mut read = Vec::new();
        loop {
            let chunk = {
                let mut next = std::pin::pin!(response.chunk());
                std::future::poll_fn(|cx| {
                    if let Poll::Ready(chunk) = next.as_mut().poll(cx) {
                        return Poll::Ready(Some(chunk));
                    }
                    timer.as_mut().poll(cx).map(|()| None)
                })
                .await
            };
            match chunk {
                Some(Ok(Some(chunk))) if read.len().saturating_add(chunk.len()) <= limit => {
                    read.extend_from_slice(&chunk);
                }
                Some(Ok(None)) => return Ok(response.read_whole(Bytes::from(read))),
                // Too long, cut off, or out of time.
                _ => break,
            }
        }
    }
    let mut head = response.read_whole(Bytes::new());
    head.headers_mut().remove(http::header::CONTENT_LENGTH);
    Ok(head)
}

/// [`keep`], while `within` runs (the wait before the retry); with no wait, what has already
/// arrived.
pub(crate) async fn keep_within<R: Reply>(
    outcome: Outcome<R>,
    limit: usize,
    within: Option<crate::clock::AttemptTimer>,
) -> Outcome<R> {
    match within {
        Some(timer) => keep(outcome, limit, std::pin::pin!(timer)).await,
        None => keep(outcome, limit, std::pin::pin!(std::future::ready(()))).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::{Body as HttpBody, Frame};
    use reqwest::Body;
    use std::task::Context;

    /// A body of `chunks`, then, if `fails`, an error instead of its end. `length`: the size it
    /// declares (reqwest's `content_length()` reads it from here, not from the header).
    struct Scripted {
        chunks: std::collections::VecDeque<Bytes>,
        fails: bool,
        length: Option<u64>,
    }

    impl HttpBody for Scripted {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            match self.chunks.pop_front() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None if self.fails => {
                    self.fails = false;
                    Poll::Ready(Some(Err(std::io::Error::other("cut off"))))
                }
                None => Poll::Ready(None),
            }
        }

        fn size_hint(&self) -> SizeHint {
            self.length.map_or_else(SizeHint::new, SizeHint::with_exact)
        }
    }

    fn response(chunks: &[usize], fails: bool, length: Option<usize>) -> reqwest::Response {
        let body = Scripted {
            chunks: chunks.iter().map(|&n| Bytes::from(vec![b'x'; n])).collect(),
            fails,
            length: length.map(|n| n as u64),
        };
        let response = http::Response::builder().status(200);
        reqwest::Response::from(response.body(Body::wrap(body)).unwrap())
    }

    #[tokio::test]
    async fn a_body_of_exactly_the_limit_is_read_inside_the_attempt() {
        // Read in full, so a cut after the last byte is the attempt's error, to be retried...
        let cut = buffer(response(&[8], true, Some(8)), 8).await;
        assert!(cut.is_err(), "a declared length at the limit is read");
        let cut = buffer(response(&[3], true, Some(3)), 8).await;
        assert!(cut.is_err(), "a declared length under the limit is read");
        let cut = buffer(response(&[4, 4], true, None), 8).await;
        assert!(cut.is_err(), "chunks that reach the limit are read");
        // ...and a whole body comes back in memory.
        let (whole, read) = buffer(response(&[4, 4], false, None), 8).await.unwrap();
        assert_eq!(
            read.as_deref(),
            Some(&[b'x'; 8][..]),
            "what was read is handed out too"
        );
        assert_eq!(whole.bytes().await.unwrap(), read.unwrap());
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_handed_back_as_a_stream_unread() {
        // Declared over the limit: not read at all, so its cut is the caller's to meet.
        let (streamed, read) = buffer(response(&[9], true, Some(9)), 8).await.unwrap();
        assert_eq!(read, None);
        assert!(streamed.bytes().await.is_err());
        // Found over the limit while reading: what was read comes first, then the rest.
        let (streamed, read) = buffer(response(&[5, 4, 3], false, None), 8).await.unwrap();
        assert_eq!(read, None);
        assert_eq!(streamed.bytes().await.unwrap().len(), 12);
    }

    #[test]
    fn a_prefix_hands_out_its_chunks_in_order_skipping_empty_ones() {
        let b = |text: &'static str| Bytes::from_static(text.as_bytes());
        let mut both = Prefix::new(b("ab"), b("cde"));
        assert_eq!((both.len(), both.is_empty()), (5, false));
        let hint = both.before(SizeHint::with_exact(4));
        assert_eq!((hint.lower(), hint.upper()), (9, Some(9)));
        assert_eq!(both.pop(), Some(b("ab")));
        assert_eq!((both.len(), both.is_empty()), (3, false));
        assert_eq!(both.pop(), Some(b("cde")));
        assert_eq!((both.len(), both.is_empty(), both.pop()), (0, true, None));
        let mut second = Prefix::new(Bytes::new(), b("x"));
        assert_eq!(
            (second.len(), second.pop(), second.is_empty()),
            (1, Some(b("x")), true)
        );
        let mut first = Prefix::new(b("y"), Bytes::new());
        assert_eq!((first.pop(), first.is_empty()), (Some(b("y")), true));
        let none = Prefix::new(Bytes::new(), Bytes::new());
        assert!(none.is_empty());
        let open = none.before(SizeHint::new());
        assert_eq!((open.lower(), open.upper()), (0, None));
    }

    /// Only a final answer's body is read inside its attempt: not a transient answer's (it
    /// would be read only to be thrown away), not an error's (it has none), and not when the
    /// classifier has read it already.
    #[test]
    fn only_a_final_answer_s_body_is_read_and_only_once() {
        use crate::engine::classify::{Cause, Judging, Verdict};
        use crate::engine::policy::RetryPolicy;
        use crate::stop::StopReason;

        let policy = RetryPolicy::builder().buffer_body(64).build().unwrap();
        let judging = Judging {
            policy: &policy,
            repeatable: true,
            key: None,
            key_sent: false,
            hook: None,
        };
        let answer = || Ok(reqwest::Response::from(http::Response::new("")));
        let failed = || -> Outcome<reqwest::Response> {
            let other = std::io::Error::other("x");
            Err(crate::error::LastError::Beneath(
                reqwest_middleware::Error::middleware(other),
            ))
        };
        let done = Verdict::Final(StopReason::Succeeded);
        let again = Verdict::Transient(Cause::Status { throttled: false });
        assert_eq!(to_read(&judging, &answer(), done), Some(64));
        assert_eq!(to_read(&judging, &answer(), again), None);
        let refused = Verdict::Final(StopReason::NotRetryable);
        assert_eq!(to_read(&judging, &failed(), refused), None);
        let unbuffered = RetryPolicy::default();
        let plain = Judging {
            policy: &unbuffered,
            ..judging
        };
        assert_eq!(to_read(&plain, &answer(), done), None);
    }
}
