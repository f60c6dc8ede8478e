//! The body of an answer through the tower door: the inner service's own, passed on as it
//! comes, or what the layer read of it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};

use crate::driver::body::{Prefix, Reply};
use crate::error::BoxError;
use crate::maybe_send::MaybeSend;
use std::future::Future;

/// The body of an answer through [`RetryService`](crate::RetryService) (feature `tower`): the
/// inner service's body `B`, passed on frame by frame as it comes, unless the layer read it.
///
/// The layer reads a body in two cases: with
/// [`buffer_body`](crate::RetryPolicyBuilder::buffer_body) on, inside the attempt (a body cut
/// off is then the attempt's error, and retried); and through the wait before a retry, an answer
/// kept so that a stop after the wait hands back the server's whole answer. A body read whole
/// is handed out from memory; one longer than the limit, what was read first and then the rest.
/// Either way its frames are the same bytes in the same order.
///
/// Its data is [`Bytes`] and its error the inner body's, boxed. Read it as any `http_body::Body`,
/// for example with `http_body_util::BodyExt::collect`.
#[derive(Debug)]
pub struct RetryBody<B> {
    kind: Kind<B>,
}

#[derive(Debug)]
enum Kind<B> {
    /// The inner service's body, unread.
    Inner(B),
    /// Read whole into memory (empty once handed out, or when the layer dropped it).
    Whole(Bytes),
    /// Read in part: what was read, then the rest as it comes (boxed: a body over the limit is
    /// rare, and the answer is moved whole through the driver).
    Prefixed(Box<(Prefix, B)>),
}

impl<B> RetryBody<B> {
    /// The inner service's body, as it came.
    pub(crate) fn inner(body: B) -> Self {
        RetryBody {
            kind: Kind::Inner(body),
        }
    }

    /// A body read whole into `bytes` (the rest of this one dropped).
    pub(crate) fn whole(bytes: Bytes) -> Self {
        RetryBody {
            kind: Kind::Whole(bytes),
        }
    }

    /// This body with `read` before what is left of it: what was read of it already.
    pub(crate) fn after(self, read: Prefix) -> Self {
        let kind = match self.kind {
            Kind::Inner(rest) => Kind::Prefixed(Box::new((read, rest))),
            // Not what the driver does (it reads an answer's body once, from the start), but
            // kept right: what was read, then whatever this body had not handed out yet.
            Kind::Whole(left) => Kind::Whole(joined(read, Prefix::new(left, Bytes::new()))),
            Kind::Prefixed(mut prefixed) => {
                let left = std::mem::take(&mut prefixed.0);
                prefixed.0 = Prefix::new(joined(read, left), Bytes::new());
                Kind::Prefixed(prefixed)
            }
        };
        RetryBody { kind }
    }
}

/// The chunks of `first`, then those of `then`, in one piece.
fn joined(mut first: Prefix, mut then: Prefix) -> Bytes {
    let mut all = BytesMut::new();
    // Bounded: a prefix holds two chunks.
    while let Some(chunk) = first.pop().or_else(|| then.pop()) {
        all.extend_from_slice(&chunk);
    }
    all.freeze()
}

/// The next frame of an inner body, its data as `Bytes` and its error boxed.
fn poll_inner<B>(body: &mut B, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body + Unpin,
    B::Data: Into<Bytes>,
    B::Error: Into<BoxError>,
{
    let frame = std::task::ready!(Pin::new(body).poll_frame(cx));
    Poll::Ready(frame.map(|frame| frame.map(|f| f.map_data(Into::into)).map_err(Into::into)))
}

impl<B> Body for RetryBody<B>
where
    B: Body + Unpin,
    B::Data: Into<Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.kind {
            Kind::Inner(body) => poll_inner(body, cx),
            Kind::Whole(bytes) => {
                let bytes = std::mem::take(bytes);
                Poll::Ready((!bytes.is_empty()).then(|| Ok(Frame::data(bytes))))
            }
            Kind::Prefixed(prefixed) => match prefixed.0.pop() {
                Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
                None => poll_inner(&mut prefixed.1, cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner(body) => body.is_end_stream(),
            Kind::Whole(bytes) => bytes.is_empty(),
            Kind::Prefixed(prefixed) => prefixed.0.is_empty() && prefixed.1.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner(body) => body.size_hint(),
            Kind::Whole(bytes) => SizeHint::with_exact(bytes.len() as u64),
            Kind::Prefixed(prefixed) => prefixed.0.before(prefixed.1.size_hint()),
        }
    }
}

/// An answer of a door typed in `http` (tower's, gRPC's): the inner service's, its body read a frame at a time, and
/// replaced in place by what was read of it.
impl<R> Reply for http::Response<RetryBody<R>>
where
    R: http_body::Body + Unpin + Send + 'static,
    R::Data: Into<Bytes>,
    R::Error: Into<BoxError>,
{
    fn status(&self) -> http::StatusCode {
        http::Response::status(self)
    }

    fn headers(&self) -> &http::HeaderMap {
        http::Response::headers(self)
    }

    fn headers_mut(&mut self) -> &mut http::HeaderMap {
        http::Response::headers_mut(self)
    }

    fn carry(&mut self, record: crate::record::RetryRecord) {
        http::Response::extensions_mut(self).insert(record);
    }

    fn content_length(&self) -> Option<u64> {
        http_body::Body::size_hint(self.body()).exact()
    }

    /// A body's error is judged as the inner service's errors are: by their causes.
    type Error = BoxError;

    fn chunk(&mut self) -> impl Future<Output = Result<Option<Bytes>, BoxError>> + MaybeSend {
        std::future::poll_fn(|cx| {
            // Bounded by what the body has ready: a frame that is not data (trailers) is
            // passed over, and the next one polled at once.
            loop {
                let frame = std::task::ready!(Pin::new(self.body_mut()).poll_frame(cx));
                match frame {
                    None => return Poll::Ready(Ok(None)),
                    Some(Err(e)) => return Poll::Ready(Err(e)),
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            return Poll::Ready(Ok(Some(data)));
                        }
                    }
                }
            }
        })
    }

    fn read_whole(self, body: Bytes) -> Self {
        self.map(|_| RetryBody::whole(body))
    }

    fn read_first(self, read: Prefix) -> Self {
        self.map(|rest| rest.after(read))
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn b(text: &'static str) -> Bytes {
        Bytes::from_static(text.as_bytes())
    }

    fn inner(text: &'static str) -> RetryBody<http_body_util::Full<Bytes>> {
        RetryBody::inner(http_body_util::Full::new(b(text)))
    }

    async fn text<B>(body: RetryBody<B>) -> String
    where
        B: Body + Unpin,
        B::Data: Into<Bytes>,
        B::Error: Into<BoxError>,
    {
        let bytes = body.collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    fn hint<B>(body: &RetryBody<B>) -> (u64, Option<u64>)
    where
        B: Body + Unpin,
        B::Data: Into<Bytes>,
        B::Error: Into<BoxError>,
    {
        let hint = body.size_hint();
        (hint.lower(), hint.upper())
    }

    #[tokio::test]
    async fn the_inner_body_passes_through_as_it_is() {
        let body = inner("abc");
        assert_eq!((hint(&body), body.is_end_stream()), ((3, Some(3)), false));
        assert_eq!(text(body).await, "abc");
        assert!(inner("").is_end_stream());
    }

    #[tokio::test]
    async fn a_body_read_whole_is_handed_out_once_from_memory() {
        let mut body = RetryBody::<http_body_util::Full<Bytes>>::whole(b("xyz"));
        assert_eq!((hint(&body), body.is_end_stream()), ((3, Some(3)), false));
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "xyz");
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
        let empty = RetryBody::<http_body_util::Full<Bytes>>::whole(Bytes::new());
        assert_eq!((hint(&empty), empty.is_end_stream()), ((0, Some(0)), true));
    }

    #[tokio::test]
    async fn what_was_read_comes_first_then_the_rest() {
        let body = inner("efg").after(Prefix::new(b("ab"), b("cd")));
        assert_eq!((hint(&body), body.is_end_stream()), ((7, Some(7)), false));
        assert_eq!(text(body).await, "abcdefg");
        let only_read = inner("").after(Prefix::new(b("ab"), Bytes::new()));
        assert!(!only_read.is_end_stream());
        assert!(inner("").after(Prefix::default()).is_end_stream());
    }

    /// Not what the driver does, but kept right: a body read into twice hands out every byte
    /// once, in order.
    #[tokio::test]
    async fn a_body_read_into_again_keeps_every_byte_in_order() {
        let whole = RetryBody::<http_body_util::Full<Bytes>>::whole(b("cd"));
        assert_eq!(text(whole.after(Prefix::new(b("a"), b("b")))).await, "abcd");
        let mut prefixed = inner("ef").after(Prefix::new(b("b"), b("cd")));
        let frame = prefixed.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "b");
        let again = prefixed.after(Prefix::new(b("a"), b("b")));
        assert_eq!(hint(&again), (6, Some(6)));
        assert_eq!(text(again).await, "abcdef");
    }

    /// The inner body's error comes out boxed, as it was.
    #[tokio::test]
    async fn the_inner_body_s_error_comes_out_as_it_was() {
        /// A body whose first frame is an error.
        struct Failing;
        impl Body for Failing {
            type Data = Bytes;
            type Error = std::io::Error;
            fn poll_frame(
                self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
                Poll::Ready(Some(Err(std::io::Error::other("cut"))))
            }
        }
        let failing = Failing;
        let mut body = RetryBody::inner(failing);
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(
            err.downcast_ref::<std::io::Error>().unwrap().to_string(),
            "cut"
        );
    }
}
