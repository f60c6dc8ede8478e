//! A gRPC call as the driver keeps and copies it: tonic's request, its body read into memory
//! when all of it is at hand and within the buffer limits, and the hold on the channel's buffer
//! that keeps it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::driver::beneath_service;
use crate::driver::claim::{self, Address, Outgoing};
use crate::driver::send_body::SendBody;
use crate::engine::seen::Locate;

/// The body of a call's copies: tonic's body, kept whole as bytes when it can be replayed.
pub(super) type CallBody = SendBody<tonic::body::Body>;

/// One call: its request, and, while it can be replayed, the bytes the channel's buffer holds
/// for it. A call past a buffer limit holds nothing and is sent once: it is committed.
pub(crate) struct Call {
    pub(super) request: http::Request<CallBody>,
    pub(super) held: Option<Held>,
}

/// Bytes of the channel's buffer held for a call, given back when its original is sent or
/// dropped.
pub(crate) struct Held {
    channel: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.channel.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// What every call through one layer shares: the bytes held for replays, and the limits.
#[derive(Debug)]
pub(crate) struct Buffer {
    held: Arc<AtomicUsize>,
    per_call: usize,
    per_channel: usize,
}

impl Buffer {
    pub(super) fn new(per_call: usize, per_channel: usize) -> Self {
        Buffer {
            held: Arc::default(),
            per_call,
            per_channel,
        }
    }

    /// A hold on `body`'s bytes, if it is whole in memory and within both limits; else
    /// `None`, and the call is sent once.
    pub(super) fn hold(&self, body: &CallBody) -> Option<Held> {
        let bytes = body.as_bytes()?.len();
        if bytes > self.per_call {
            return None;
        }
        let most = self.per_channel;
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(bytes).filter(|&now| now <= most)
            })
            .ok()?;
        Some(Held {
            channel: self.held.clone(),
            bytes,
        })
    }

    /// The bytes held now, for the tests.
    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

impl Outgoing for Call {
    fn method(&self) -> &http::Method {
        self.request.method()
    }

    fn headers(&self) -> &http::HeaderMap {
        self.request.headers()
    }

    fn headers_mut(&mut self) -> &mut http::HeaderMap {
        self.request.headers_mut()
    }

    /// Whole, and held by the channel's buffer: a call past a limit is committed.
    fn whole_body(&self) -> bool {
        self.held.is_some() && self.request.body().as_bytes().is_some()
    }

    /// A copy without the extensions (the driver hands each copy its own), the bytes shared by
    /// reference count; none for a committed call.
    fn try_clone(&self) -> Option<Self> {
        self.held.as_ref()?;
        Some(Call {
            request: beneath_service::copy_of(&self.request)?,
            held: None,
        })
    }

    /// The call's own request, a copy kept in its place with the hold on the buffer: tonic's
    /// request has room for the headers the channel adds, a copy's would grow (about 560
    /// instructions a call).
    fn copy_to_send(&mut self) -> Option<Self> {
        let mut copy = self.try_clone()?;
        std::mem::swap(&mut self.request, &mut copy.request);
        Some(copy)
    }

    fn locate(&self) -> &dyn Locate {
        self.request.uri()
    }

    fn address(&self) -> Address<'_> {
        claim::address_of(self.request.uri())
    }

    fn uri(&self) -> http::Uri {
        self.request.uri().clone()
    }

    /// Of the method and the URI's path, `/pkg.Service/Method`: a generated client's URI is its
    /// path alone (the channel adds where it goes), and the path names the call.
    /// As the other doors name a request: its method and its URL's text (its path alone when
    /// the call carries no origin, as tonic's generated clients send it).
    fn fingerprint(&self) -> u64 {
        crate::driver::uri::fingerprint(self.request.method(), self.request.uri())
    }

    type Gone = http::Uri;

    fn gone(&self) -> http::Uri {
        self.request.uri().clone()
    }

    /// The URL of an absolute URI; none for a path alone.
    fn url_of(gone: &http::Uri) -> Option<url::Url> {
        gone.scheme()?;
        url::Url::parse(&gone.to_string()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn body(len: usize) -> CallBody {
        SendBody::whole(Bytes::from(vec![1u8; len]))
    }

    #[test]
    fn a_call_is_held_within_both_limits_and_given_back_when_dropped() {
        let buffer = Buffer::new(10, 15);
        let first = buffer.hold(&body(10)).expect("within both");
        assert_eq!(buffer.held(), 10);
        assert!(buffer.hold(&body(11)).is_none(), "past the call's limit");
        assert!(buffer.hold(&body(6)).is_none(), "past the channel's");
        let second = buffer.hold(&body(5)).expect("up to the channel's limit");
        assert_eq!(buffer.held(), 15);
        drop(first);
        assert_eq!(buffer.held(), 5);
        drop(second);
        assert_eq!(buffer.held(), 0);
    }

    #[test]
    fn a_committed_call_has_no_copy_and_a_held_one_copies_its_head_and_bytes() {
        let buffer = Buffer::new(100, 100);
        let mut request = http::Request::new(body(3));
        *request.method_mut() = "POST".parse().unwrap();
        *request.uri_mut() = "/echo.Echo/Say".parse().unwrap();
        request
            .headers_mut()
            .insert("te", "trailers".parse().unwrap());
        let held = buffer.hold(request.body());
        let call = Call { request, held };
        assert!(call.whole_body());
        let copy = call.try_clone().expect("held");
        assert_eq!(copy.request.uri(), "/echo.Echo/Say");
        assert_eq!(copy.request.headers()["te"], "trailers");
        assert_eq!(copy.request.body().as_bytes().unwrap().len(), 3);
        assert!(
            copy.try_clone().is_none(),
            "a copy holds nothing: it is sent once"
        );
        assert!(
            Call::url_of(&call.gone()).is_none(),
            "a path alone has no URL"
        );
        let absolute: http::Uri = "http://127.0.0.1:1/a.B/C".parse().unwrap();
        assert_eq!(
            Call::url_of(&absolute).unwrap().as_str(),
            "http://127.0.0.1:1/a.B/C"
        );
        let committed = Call {
            request: http::Request::new(body(3)),
            held: None,
        };
        assert!(!committed.whole_body() && committed.try_clone().is_none());
    }

    #[test]
    fn the_call_itself_is_sent_and_a_copy_kept_in_its_place_with_the_hold() {
        let buffer = Buffer::new(100, 100);
        let mut request = http::Request::new(body(4));
        *request.uri_mut() = "/echo.Echo/Say".parse().unwrap();
        request
            .headers_mut()
            .insert("te", "trailers".parse().unwrap());
        // What tells the call itself from a copy: a copy has no extensions.
        request.extensions_mut().insert("the call itself");
        let held = buffer.hold(request.body());
        let mut call = Call { request, held };
        let sent = call.copy_to_send().expect("held");
        assert_eq!(sent.request.extensions().get(), Some(&"the call itself"));
        assert!(sent.held.is_none() && call.whole_body());
        assert_eq!(call.request.extensions().get::<&str>(), None);
        assert_eq!(call.request.headers()["te"], "trailers");
        assert_eq!(call.request.uri(), "/echo.Echo/Say");
        drop(sent);
        assert_eq!(buffer.held(), 4, "the kept copy holds its bytes");
        drop(call);
        assert_eq!(buffer.held(), 0);
        let mut committed = Call {
            request: http::Request::new(body(3)),
            held: None,
        };
        assert!(committed.copy_to_send().is_none());
    }
}
