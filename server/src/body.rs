//! The body of every answer the layer gives: stored bytes, or the handler's own body.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// The error of a [`ReplyBody`]: the handler's body's error, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A whole answer body: its bytes, and the trailers after them (a gRPC answer's status).
#[derive(Debug, Clone, Default)]
pub(crate) struct Whole {
    pub(crate) data: Bytes,
    pub(crate) trailers: Option<HeaderMap>,
}

pin_project! {
    /// The body of the layer's answers: whole bytes (a stored answer, a replay, a problem), or
    /// the handler's body passed through (a route the layer does not guard, or an answer too
    /// large to store, after the part already read).
    pub struct ReplyBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        Inner { prefix: Option<Bytes>, #[pin] body: B },
    }
}

impl<B> ReplyBody<B> {
    /// Whole bytes.
    pub(crate) fn full(data: Bytes) -> ReplyBody<B> {
        ReplyBody::whole(Whole {
            data,
            trailers: None,
        })
    }

    /// Whole bytes, then trailers if any.
    pub(crate) fn whole(whole: Whole) -> ReplyBody<B> {
        ReplyBody {
            kind: Kind::Full {
                data: (!whole.data.is_empty()).then_some(whole.data),
                trailers: whole.trailers,
            },
        }
    }

    /// The handler's body, after `prefix` (what the layer already read of it).
    pub(crate) fn inner(prefix: Bytes, body: B) -> ReplyBody<B> {
        ReplyBody {
            kind: Kind::Inner {
                prefix: (!prefix.is_empty()).then_some(prefix),
                body,
            },
        }
    }
}

impl<B> Body for ReplyBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Full { data, trailers } => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
            KindProj::Inner { prefix, body } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => body.poll_frame(cx).map_err(Into::into),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Inner { prefix, body } => prefix.is_none() && body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { prefix, body } => {
                let before = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let hint = body.size_hint();
                let mut sum = SizeHint::new();
                sum.set_lower(hint.lower().saturating_add(before));
                if let Some(upper) = hint.upper() {
                    sum.set_upper(upper.saturating_add(before));
                }
                sum
            }
        }
    }
}

/// The body of the requests a reconciler runs again, and of a consumer's messages: the saved
/// body or the payload, whole.
pub type SavedBody = http_body_util::Full<Bytes>;

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn whole_bytes_are_one_frame_with_an_exact_size() {
        let body: ReplyBody<Full<Bytes>> = ReplyBody::full(Bytes::from_static(b"stored"));
        assert_eq!(body.size_hint().exact(), Some(6));
        assert!(!body.is_end_stream());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "stored");
        let empty: ReplyBody<Full<Bytes>> = ReplyBody::full(Bytes::new());
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));
    }

    #[tokio::test]
    async fn whole_bytes_are_followed_by_their_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let body: ReplyBody<Full<Bytes>> = ReplyBody::whole(Whole {
            data: Bytes::from_static(b"m"),
            trailers: Some(trailers.clone()),
        });
        assert!(!body.is_end_stream());
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "m");
        let only: ReplyBody<Full<Bytes>> = ReplyBody::whole(Whole {
            data: Bytes::new(),
            trailers: Some(trailers.clone()),
        });
        assert!(!only.is_end_stream());
        assert_eq!(only.collect().await.unwrap().trailers(), Some(&trailers));
    }

    #[tokio::test]
    async fn the_handler_s_body_follows_what_was_read_of_it() {
        let body = ReplyBody::inner(
            Bytes::from_static(b"head-"),
            Full::new(Bytes::from_static(b"tail")),
        );
        assert_eq!(body.size_hint().exact(), Some(9));
        assert!(!body.is_end_stream());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "head-tail");
        let body = ReplyBody::inner(Bytes::new(), Full::new(Bytes::new()));
        assert!(body.is_end_stream());
    }

    /// A body that sends "a" and then fails.
    struct Failing(bool);

    impl Body for Failing {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            if std::mem::replace(&mut self.0, true) {
                Poll::Ready(Some(Err(std::io::Error::other("cut"))))
            } else {
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"a")))))
            }
        }
    }

    #[tokio::test]
    async fn an_error_of_the_handler_s_body_comes_through() {
        let body = ReplyBody::inner(Bytes::new(), Failing(false));
        let err = body.collect().await.unwrap_err();
        assert_eq!(err.to_string(), "cut");
    }
}
