//! The body of a request through the tower door, as each copy carries it to the inner service:
//! the caller's body kept whole in memory (and cloned by reference count for every copy), or,
//! when it streams, the caller's own body, sent once.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use crate::driver::body::Prefix;
use crate::error::BoxError;

/// The body of each copy of a request that [`RetryService`](crate::RetryService) hands to the
/// inner service (feature `tower`), made from the caller's body `B`.
///
/// A body that is whole in memory (any whose frames are all at hand when the request is made:
/// `Full<Bytes>`, a `String`, `Empty`, a `reqwest::Body` made from bytes) is kept as [`Bytes`],
/// and each copy carries a clone of them by reference count: no byte is copied, however large
/// the body. Any other body (a stream, a file) is sent once, as it comes, after what was already
/// at hand; the request is then not retried, and its record says why.
///
/// Its data is [`Bytes`] and its error the caller's body's, boxed. A client generic over its
/// request body (hyper-util's `Client<C, B>`) takes it as it is; one fixed to a body type of its
/// own takes it through a `map_request`, for example tonic's `tonic::body::Body::new` or
/// `http_body_util::BodyExt::boxed_unsync`.
pub struct SendBody<B> {
    kind: Kind<B>,
}

enum Kind<B> {
    /// Whole in memory: handed out once (a copy is a new `SendBody` over the same bytes).
    Whole(Option<Bytes>),
    /// The caller's body, sent once (boxed: it was pinned to be read, and streams are rare).
    Once(Box<Once<B>>),
}

/// A streaming body: what was at hand when the request was made, then the rest as it comes.
struct Once<B> {
    read: Prefix,
    /// Trailers, or an error, that came among what was at hand.
    then: Option<Result<HeaderMap, BoxError>>,
    rest: Pin<Box<B>>,
}

impl<B> std::fmt::Debug for SendBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Whole(bytes) => f
                .debug_struct("SendBody")
                .field("whole", &bytes.as_ref().map_or(0, Bytes::len))
                .finish(),
            Kind::Once(_) => f.debug_struct("SendBody").field("once", &true).finish(),
        }
    }
}

impl<B> SendBody<B>
where
    B: Body,
    B::Data: Into<Bytes>,
    B::Error: Into<BoxError>,
{
    /// The caller's `body`, read as far as it is at hand: whole in memory if all of it is,
    /// else sent once. Never waits: a frame that is not ready ends the reading.
    pub(crate) fn new(mut body: B) -> Self
    where
        B: 'static,
    {
        if body.is_end_stream() {
            return SendBody::whole(Bytes::new());
        }
        // The bodies most callers send, whose type says they are in memory, read in place
        // (they need no pinning): no allocation.
        if let Some(bytes) = in_memory(&mut body) {
            return SendBody::whole(bytes);
        }
        let mut rest = Box::pin(body);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let (mut first, mut more): (Option<Bytes>, Option<BytesMut>) = (None, None);
        let then = loop {
            match rest.as_mut().poll_frame(&mut cx) {
                Poll::Ready(None) => {
                    let whole = match (first, more) {
                        (_, Some(more)) => more.freeze(),
                        (Some(first), None) => first,
                        (None, None) => Bytes::new(),
                    };
                    return SendBody::whole(whole);
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let data: Bytes = data.into();
                        match (&mut first, &mut more) {
                            (None, _) => first = Some(data),
                            (Some(head), None) => {
                                let mut joined = BytesMut::with_capacity(head.len() + data.len());
                                joined.extend_from_slice(head);
                                joined.extend_from_slice(&data);
                                more = Some(joined);
                            }
                            (Some(_), Some(joined)) => joined.extend_from_slice(&data),
                        }
                    }
                    Err(frame) => break frame.into_trailers().ok().map(Ok),
                },
                Poll::Ready(Some(Err(e))) => break Some(Err(e.into())),
                Poll::Pending => break None,
            }
        };
        let read = match (first, more) {
            (_, Some(more)) => more.freeze(),
            (first, None) => first.unwrap_or_default(),
        };
        let read = Prefix::new(read, Bytes::new());
        SendBody {
            kind: Kind::Once(Box::new(Once { read, then, rest })),
        }
    }
}

/// The bytes of `body` when its type is one that holds them in memory (`Full<Bytes>`, a
/// `String`, a `reqwest::Body` made from bytes), read without pinning it; `None` for any other.
fn in_memory<B: 'static>(body: &mut B) -> Option<Bytes> {
    let any: &mut dyn std::any::Any = body;
    if let Some(full) = any.downcast_mut::<http_body_util::Full<Bytes>>() {
        return drain(full);
    }
    if let Some(text) = any.downcast_mut::<String>() {
        return Some(Bytes::from(std::mem::take(text)));
    }
    #[cfg(feature = "reqwest")]
    if let Some(reqwest) = any.downcast_mut::<reqwest::Body>() {
        if reqwest.as_bytes().is_some() {
            return drain(reqwest);
        }
    }
    None
}

/// The data of a body whose frames are all at hand, one frame of data and its end, read in
/// place; `None` (having read nothing) otherwise.
fn drain<T>(body: &mut T) -> Option<Bytes>
where
    T: Body<Data = Bytes> + Unpin,
{
    let mut cx = Context::from_waker(std::task::Waker::noop());
    // A body in memory gives its data in one frame; a second would have been joined with it
    // by the general path, which this one leaves a body it cannot read whole to.
    body.size_hint().exact()?;
    let data = match Pin::new(&mut *body).poll_frame(&mut cx) {
        Poll::Ready(None) => return Some(Bytes::new()),
        Poll::Ready(Some(Ok(frame))) => frame.into_data().ok()?,
        _ => return None,
    };
    match Pin::new(&mut *body).poll_frame(&mut cx) {
        Poll::Ready(None) => Some(data),
        _ => None,
    }
}

impl<B> SendBody<B> {
    /// A body of `bytes`, whole in memory.
    pub(crate) fn whole(bytes: Bytes) -> Self {
        SendBody {
            kind: Kind::Whole(Some(bytes)),
        }
    }

    /// The bytes of a body whole in memory; `None` for one sent once.
    pub(crate) fn as_bytes(&self) -> Option<&Bytes> {
        match &self.kind {
            Kind::Whole(Some(bytes)) => Some(bytes),
            Kind::Whole(None) | Kind::Once(_) => None,
        }
    }
}

impl<B> Body for SendBody<B>
where
    B: Body,
    B::Data: Into<Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().kind {
            Kind::Whole(bytes) => Poll::Ready(
                bytes
                    .take()
                    .filter(|b| !b.is_empty())
                    .map(|b| Ok(Frame::data(b))),
            ),
            Kind::Once(once) => {
                if let Some(read) = once.read.pop() {
                    return Poll::Ready(Some(Ok(Frame::data(read))));
                }
                if let Some(then) = once.then.take() {
                    return Poll::Ready(Some(then.map(Frame::trailers)));
                }
                let frame = std::task::ready!(once.rest.as_mut().poll_frame(cx));
                Poll::Ready(frame.map(|frame| {
                    frame
                        .map(|frame| frame.map_data(Into::into))
                        .map_err(Into::into)
                }))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Whole(bytes) => bytes.as_ref().is_none_or(Bytes::is_empty),
            Kind::Once(once) => {
                once.read.is_empty() && once.then.is_none() && once.rest.is_end_stream()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Whole(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Kind::Once(once) => once.read.before(once.rest.size_hint()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    async fn text<B>(body: SendBody<B>) -> Result<(Bytes, Option<HeaderMap>), String>
    where
        B: Body,
        B::Data: Into<Bytes>,
        B::Error: Into<BoxError>,
    {
        let collected = body.collect().await.map_err(|e| e.to_string())?;
        let trailers = collected.trailers().cloned();
        Ok((collected.to_bytes(), trailers))
    }

    #[tokio::test]
    async fn a_body_at_hand_is_kept_whole_and_its_bytes_are_the_caller_s_own() {
        let big = Bytes::from(vec![7u8; 1 << 20]);
        let body = SendBody::new(Full::new(big.clone()));
        let kept = body.as_bytes().expect("whole");
        assert_eq!(kept.as_ptr(), big.as_ptr(), "the same bytes, not a copy");
        assert_eq!(body.size_hint().exact(), Some(1 << 20));
        assert_eq!(text(body).await.unwrap().0, big);
        // A reqwest body made from bytes, and a string: whole too.
        let reqwest = SendBody::new(reqwest::Body::from(big.clone()));
        assert_eq!(reqwest.as_bytes().map(|b| b.as_ptr()), Some(big.as_ptr()));
        let text_body = SendBody::new(String::from("order"));
        assert_eq!(text_body.as_bytes().map(|b| &b[..]), Some(&b"order"[..]));
        // One that streams, whatever its type: sent once.
        let streamed = reqwest::Body::wrap(Chunks::then_wait(&[b"ab"], &[b"cd"]));
        assert!(SendBody::new(streamed).as_bytes().is_none());
        let empty = [
            SendBody::new(String::new()).as_bytes().cloned(),
            SendBody::new(Full::new(Bytes::new())).as_bytes().cloned(),
        ];
        assert_eq!(empty, [Some(Bytes::new()), Some(Bytes::new())]);
        assert!(SendBody::new(String::new()).is_end_stream());
        // Its `Debug` says which it is, and the size of a whole one (never the bytes).
        let debug = format!("{:?}", SendBody::new(String::from("order")));
        assert_eq!(debug, "SendBody { whole: 5 }");
    }

    #[tokio::test]
    async fn several_frames_at_hand_are_joined_once() {
        let body = SendBody::new(Chunks::ready(&[b"ab", b"cd", b"e"]));
        assert_eq!(body.as_bytes().map(|b| &b[..]), Some(&b"abcde"[..]));
    }

    #[tokio::test]
    async fn a_body_that_is_not_at_hand_is_sent_once_after_what_was() {
        let body = SendBody::new(Chunks::then_wait(&[b"ab"], &[b"cd"]));
        assert!(body.as_bytes().is_none(), "sent once");
        assert_eq!(
            body.size_hint().lower(),
            2,
            "what was read, and the rest hints none"
        );
        assert_eq!(text(body).await.unwrap().0, "abcd");
        let trailed = SendBody::new(Chunks::ready(&[b"ab"]).with_trailers());
        assert!(
            trailed.as_bytes().is_none(),
            "trailers: sent once, as it came"
        );
        let (data, trailers) = text(trailed).await.unwrap();
        assert_eq!(data, "ab");
        assert_eq!(trailers.unwrap()["x-t"], "1");
        let failed = SendBody::new(Chunks::ready(&[b"ab"]).failing());
        assert_eq!(text(failed).await.unwrap_err(), "cut");
    }

    /// A body of chunks: those at hand, then (after one `Pending`, waking at once) the rest;
    /// then trailers or an error, if asked.
    struct Chunks {
        ready: Vec<Bytes>,
        later: Vec<Bytes>,
        waited: bool,
        trailers: bool,
        fails: bool,
    }

    impl Chunks {
        fn ready(ready: &[&'static [u8]]) -> Chunks {
            Chunks::then_wait(ready, &[])
        }

        fn then_wait(ready: &[&'static [u8]], later: &[&'static [u8]]) -> Chunks {
            let bytes =
                |all: &[&'static [u8]]| all.iter().rev().map(|b| Bytes::from_static(b)).collect();
            Chunks {
                ready: bytes(ready),
                later: bytes(later),
                waited: later.is_empty(),
                trailers: false,
                fails: false,
            }
        }

        fn with_trailers(mut self) -> Chunks {
            self.trailers = true;
            self
        }

        fn failing(mut self) -> Chunks {
            self.fails = true;
            self
        }
    }

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            if let Some(chunk) = self.ready.pop() {
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            if !self.waited {
                self.waited = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if let Some(chunk) = self.later.pop() {
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            if std::mem::take(&mut self.fails) {
                return Poll::Ready(Some(Err(std::io::Error::other("cut"))));
            }
            if std::mem::take(&mut self.trailers) {
                let mut trailers = HeaderMap::new();
                trailers.insert("x-t", "1".parse().unwrap());
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
            Poll::Ready(None)
        }
    }
}
