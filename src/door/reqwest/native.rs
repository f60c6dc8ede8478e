//! The reqwest door's answers and errors outside the browser: an answer's body read a chunk at
//! a time and the answer rebuilt around what was read; a request's streaming body taken as
//! bytes when it is all at hand; what reqwest's errors say of the connection.

use std::error::Error as _;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use reqwest::ResponseBuilderExt;
use reqwest::{Request, Response};

use crate::driver::body::{Prefix, Reply};
use crate::fault::{self, Fault};
use crate::maybe_send::MaybeSend;
use crate::record::RetryRecord;

impl Reply for Response {
    /// A body cut off is reqwest's error, as the chain's attempts fail.
    type Error = reqwest_middleware::Error;

    fn status(&self) -> http::StatusCode {
        Response::status(self)
    }

    fn headers(&self) -> &http::HeaderMap {
        Response::headers(self)
    }

    fn headers_mut(&mut self) -> &mut http::HeaderMap {
        Response::headers_mut(self)
    }

    fn carry(&mut self, record: RetryRecord) {
        Response::extensions_mut(self).insert(record);
    }

    fn content_length(&self) -> Option<u64> {
        Response::content_length(self)
    }

    fn chunk(
        &mut self,
    ) -> impl Future<Output = Result<Option<Bytes>, reqwest_middleware::Error>> + MaybeSend {
        let chunk = Response::chunk(self);
        async move { chunk.await.map_err(reqwest_middleware::Error::Reqwest) }
    }

    fn read_whole(self, body: Bytes) -> Self {
        rebody(self, |rest| {
            drop(rest);
            reqwest::Body::from(body)
        })
    }

    fn read_first(self, read: Prefix) -> Self {
        rebody(self, |rest| {
            reqwest::Body::wrap(Prefixed {
                read,
                then: None,
                rest,
            })
        })
    }
}

/// The same head (status, version, headers, URL, extensions) with a new body, made from what is
/// left of the old one.
pub(super) fn rebody(
    mut response: Response,
    body: impl FnOnce(reqwest::Body) -> reqwest::Body,
) -> Response {
    let status = response.status();
    let version = response.version();
    let url = response.url().clone();
    let headers = std::mem::take(Response::headers_mut(&mut response));
    let mut extensions = std::mem::take(Response::extensions_mut(&mut response));
    let body = body(reqwest::Body::from(response));
    let mut rebuilt = http::Response::builder()
        .url(url)
        .body(body)
        .unwrap_or_else(|_| unreachable!("a builder given only a URL cannot fail"));
    *rebuilt.status_mut() = status;
    *rebuilt.version_mut() = version;
    *rebuilt.headers_mut() = headers;
    // The URL (the builder's one extension) joins the answer's own map, which keeps its table:
    // no entry of it is moved.
    extensions.extend(std::mem::take(rebuilt.extensions_mut()));
    *rebuilt.extensions_mut() = extensions;
    Response::from(rebuilt)
}

/// A request whose body streams (`reqwest::Body::wrap`) but whose data is all at hand when it is
/// sent gets that data as bytes, so that it can be sent again, as the tower door keeps such a
/// body; a body still streaming keeps what was at hand, then the rest, and is sent once. A body
/// of bytes, or none, is left as it is (most requests: one look at it).
#[inline]
pub(super) fn read_at_hand(request: &mut Request) {
    if let Some(body) = request
        .body_mut()
        .as_mut()
        .filter(|b| b.as_bytes().is_none())
    {
        read_streaming(body);
    }
}

/// A streaming body made bytes if its data is all at hand, else what was at hand kept before
/// the rest (see [`read_at_hand`]).
#[inline(never)]
fn read_streaming(body: &mut reqwest::Body) {
    let mut rest = std::mem::replace(body, reqwest::Body::from(Bytes::new()));
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut read = bytes::BytesMut::new();
    // Bounded by the frames at hand: a body that is never ready stops it at once.
    let then = loop {
        match Pin::new(&mut rest).poll_frame(&mut cx) {
            Poll::Ready(None) => {
                *body = reqwest::Body::from(read.freeze());
                return;
            }
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => read.extend_from_slice(&data),
                Err(frame) => break Some(Ok(frame)),
            },
            Poll::Ready(Some(Err(e))) => break Some(Err(e)),
            Poll::Pending => break None,
        }
    };
    let read = Prefix::new(read.freeze(), Bytes::new());
    *body = reqwest::Body::wrap(Prefixed { read, then, rest });
}

/// The chunks of a body read already, then the rest of it.
struct Prefixed {
    read: Prefix,
    /// A frame that is not data (trailers), or an error, read after them.
    then: Option<Result<Frame<Bytes>, reqwest::Error>>,
    rest: reqwest::Body,
}

impl HttpBody for Prefixed {
    type Data = Bytes;
    type Error = reqwest::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, reqwest::Error>>> {
        if let Some(chunk) = self.read.pop() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if let Some(then) = self.then.take() {
            return Poll::Ready(Some(then));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty() && self.then.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.read.before(self.rest.size_hint())
    }
}

pub(super) fn reqwest_fault(err: &reqwest::Error) -> Option<Fault> {
    if err.is_builder() || err.is_redirect() || err.is_status() {
        return None;
    }
    let cause = err.source().and_then(fault::of_causes);
    // Before the timeout: a connect timeout (reqwest's `connect_timeout`) sent nothing.
    if err.is_connect() {
        return connect_fault(cause, err);
    }
    if err.is_timeout() {
        return Some(Fault::Timeout);
    }
    cause
}

/// What a connect error stands for. Only causes known to be passing make it transient: a
/// certificate that failed to verify will fail the same way again. A name that did not resolve
/// is transient: resolvers time out and lose their upstreams, and nothing was sent; so is a
/// connection that did not open in time.
fn connect_fault(cause: Option<Fault>, err: &reqwest::Error) -> Option<Fault> {
    let passing =
        cause.is_some() || err.is_timeout() || err.source().is_some_and(fault::resolution_failed);
    passing.then_some(Fault::Connect)
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::super::*;
    use super::*;
    use crate::driver::body::{Outcome, Prefix, Reply};
    use crate::engine::seen::Seen;
    use crate::error::LastError;

    /// An answer kept through a wait, whole or read in part, keeps its whole head: status,
    /// version, headers, URL and every extension (the server's and any a middleware added),
    /// and its body's bytes.
    #[tokio::test]
    async fn a_kept_answer_keeps_its_head_and_extensions() {
        #[derive(Clone, Debug, PartialEq)]
        struct Mine(u32);
        let url: reqwest::Url = "http://127.0.0.1:9/orders?id=7".parse().unwrap();
        let answer = || {
            let mut answer = http::Response::builder()
                .status(502)
                .version(http::Version::HTTP_10)
                .header("retry-after", "2")
                .url(url.clone())
                .body(reqwest::Body::from("busy"))
                .unwrap();
            answer.extensions_mut().insert(Mine(7));
            answer.extensions_mut().insert("a middleware's");
            Response::from(answer)
        };
        for kept in [
            answer().read_whole(Bytes::from_static(b"busy")),
            answer().read_first(Prefix::new(Bytes::from_static(b"bu"), Bytes::new())),
        ] {
            assert_eq!(kept.status(), 502);
            assert_eq!(kept.version(), http::Version::HTTP_10);
            assert_eq!(kept.headers()["retry-after"], "2");
            assert_eq!(kept.url(), &url);
            assert_eq!(kept.extensions().get::<Mine>(), Some(&Mine(7)));
            assert_eq!(kept.extensions().get::<&str>(), Some(&"a middleware's"));
            assert_eq!(kept.extensions().len(), 2);
            assert!(kept.bytes().await.unwrap().starts_with(b"bu"));
        }
    }

    /// A body of `chunks`, each at hand, then (if `pending`) one more after a wait, then
    /// trailers if `trailers`.
    struct Frames(std::collections::VecDeque<Bytes>, bool, bool);

    impl HttpBody for Frames {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            if let Some(chunk) = self.0.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            if std::mem::take(&mut self.1) {
                self.0.push_back(Bytes::from_static(b"!"));
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if std::mem::take(&mut self.2) {
                return Poll::Ready(Some(Ok(Frame::trailers(http::HeaderMap::new()))));
            }
            Poll::Ready(None)
        }
    }

    #[tokio::test]
    async fn a_stream_all_at_hand_becomes_bytes_and_any_other_keeps_every_frame() {
        let request = |pending, trailers| {
            let chunks = [&b"ab"[..], b"cd"].map(Bytes::from_static);
            let body = reqwest::Body::wrap(Frames(chunks.into_iter().collect(), pending, trailers));
            let client = reqwest::Client::new();
            let mut request = client.put("http://x.example/").body(body).build().unwrap();
            read_at_hand(&mut request);
            request
        };
        let whole = request(false, false);
        assert_eq!(whole.body().and_then(|b| b.as_bytes()), Some(&b"abcd"[..]));
        assert!(whole.try_clone().is_some(), "sent again");
        for (pending, trailers, data) in [(true, false, &b"abcd!"[..]), (false, true, b"abcd")] {
            let mut streamed = request(pending, trailers);
            assert!(streamed.try_clone().is_none(), "sent once");
            let body = streamed.body_mut().take().unwrap();
            let collected = http_body_util::BodyExt::collect(body).await.unwrap();
            assert_eq!(collected.trailers().is_some(), trailers);
            assert_eq!(&collected.to_bytes()[..], data);
        }
        // A request without a body, or with bytes, is left as it is.
        let mut plain = reqwest::Client::new()
            .get("http://x.example/")
            .build()
            .unwrap();
        read_at_hand(&mut plain);
        assert!(plain.body().is_none());
    }

    #[test]
    fn a_prefixed_body_reports_its_size_and_its_end() {
        let prefixed = |read: &'static [u8], over: &'static [u8], rest: &'static [u8]| Prefixed {
            read: Prefix::new(Bytes::from_static(read), Bytes::from_static(over)),
            then: None,
            rest: reqwest::Body::from(rest),
        };
        let body = prefixed(b"ab", b"cd", b"efg");
        let hint = body.size_hint();
        assert_eq!((hint.lower(), hint.upper()), (7, Some(7)));
        assert!(!body.is_end_stream(), "the prefix is still to come");
        assert!(prefixed(b"", b"", b"").is_end_stream());
        assert!(!prefixed(b"ab", b"", b"").is_end_stream());
        assert!(!prefixed(b"", b"", b"xyz").is_end_stream());
    }

    /// What was read comes first, then the rest, and the head stays as it was.
    #[tokio::test]
    async fn an_answer_read_in_part_or_whole_keeps_its_head_and_its_bytes_in_order() {
        let answer = || {
            let mut answer = http::Response::builder()
                .status(201)
                .header("x-a", "1")
                .body("efg")
                .unwrap();
            answer.extensions_mut().insert(7u8);
            Response::from(answer)
        };
        let read = Prefix::new(Bytes::from_static(b"ab"), Bytes::from_static(b"cd"));
        let mut first = answer().read_first(read);
        assert_eq!(first.status(), 201);
        assert_eq!(first.headers()["x-a"], "1");
        assert_eq!(first.extensions_mut().get::<u8>(), Some(&7));
        assert_eq!(first.bytes().await.unwrap(), "abcdefg");
        let whole = answer().read_whole(Bytes::from_static(b"xyz"));
        assert_eq!(whole.status(), 201);
        assert_eq!(whole.bytes().await.unwrap(), "xyz");
    }

    /// An outcome of this door, as the driver reads it.
    fn seen(outcome: &Outcome<Response>) -> Seen<'_> {
        crate::driver::claim::seen_of(outcome, head, failure)
    }

    fn may_have_reached(outcome: &Outcome<Response>) -> bool {
        seen(outcome).may_have_reached()
    }

    /// The chain's error, as an attempt's outcome.
    fn failed(err: impl Into<reqwest_middleware::Error>) -> Outcome<Response> {
        Err(LastError::Beneath(err.into()))
    }

    #[test]
    fn only_an_error_that_certainly_sent_nothing_kept_the_key_from_the_server() {
        let ok = Response::from(http::Response::new(""));
        assert!(may_have_reached(&Ok(ok)));
        let timeout = Err(crate::driver::claim::timed_out(
            std::time::Duration::from_millis(5),
        ));
        let Seen::Failed(cut) = seen(&timeout) else {
            panic!("a timeout is a failure");
        };
        assert_eq!(cut.fault, Some(Fault::Timeout), "the layer's own timeout");
        assert!(may_have_reached(&timeout));
        let other = failed(reqwest_middleware::Error::middleware(io::Error::other("x")));
        assert!(may_have_reached(&other));
    }

    #[tokio::test]
    async fn a_refused_connection_kept_the_key_from_the_server() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let refused = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .unwrap_err();
        let refused = failed(refused);
        assert!(!may_have_reached(&refused));
        // The classifier sees reqwest's own error.
        let Seen::Failed(failure) = seen(&refused) else {
            panic!("an error is a failure");
        };
        assert_eq!(failure.fault, Some(Fault::Connect));
        assert!(failure.error.downcast_ref::<reqwest::Error>().is_some());
    }

    #[test]
    fn builder_errors_are_permanent() {
        let client = reqwest::Client::new();
        let err = client.get("not a url").build().unwrap_err();
        assert!(err.is_builder());
        assert_eq!(transport_fault(&err.into()), None);
    }

    #[test]
    fn other_middleware_errors_are_permanent() {
        let err = reqwest_middleware::Error::middleware(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "from another middleware",
        ));
        assert_eq!(transport_fault(&err), None);
        // The classifier sees that middleware's own error.
        let failed = failed(err);
        let Seen::Failed(failure) = seen(&failed) else {
            panic!("an error is a failure");
        };
        assert!(failure.error.downcast_ref::<io::Error>().is_some());
    }

    #[test]
    fn only_a_body_whole_in_memory_can_be_sent_twice() {
        let mut request =
            Request::new("GET".parse().unwrap(), "http://127.0.0.1/".parse().unwrap());
        assert!(request.whole_body(), "no body");
        *request.body_mut() = Some(reqwest::Body::from("whole"));
        assert!(request.whole_body());
        assert!(Outgoing::try_clone(&request).is_some());
        let other = http_body_util::Full::new(bytes::Bytes::from_static(b"read as it comes"));
        *request.body_mut() = Some(reqwest::Body::wrap(other));
        assert!(!request.whole_body());
        assert!(Outgoing::try_clone(&request).is_none());
    }

    /// A body that declares its length over the limit is not read at all: the answer comes back
    /// at once, even from a body that would never give a byte.
    #[test]
    fn a_declared_length_over_the_limit_is_not_read() {
        struct Never;
        impl http_body::Body for Never {
            type Data = bytes::Bytes;
            type Error = std::io::Error;
            fn poll_frame(
                self: Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>>
            {
                std::task::Poll::Pending
            }
            fn size_hint(&self) -> http_body::SizeHint {
                http_body::SizeHint::with_exact(9)
            }
        }
        let response = Response::from(http::Response::new(reqwest::Body::wrap(Never)));
        assert_eq!(Reply::content_length(&response), Some(9));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let read = std::pin::pin!(crate::driver::body::buffer(response, 8));
        let std::task::Poll::Ready(Ok((_, None))) = read.poll(&mut cx) else {
            panic!("a body declared over the limit is handed back unread, at once");
        };
    }
}
