//! This door's side of the driver: where each copy goes (the inner service, `Beneath`), the
//! request as the driver keeps and copies it (`Outgoing`) and an answer as it reads it (`Reply`).

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Extensions;
use tower_service::Service;

use super::error::{BoxError, service_fault};
use super::future::Call;
use crate::driver::beneath_service;
use crate::driver::claim::{Address, Beneath, Claimed, Outgoing};
use crate::driver::retry_body::RetryBody;
use crate::driver::send_body::SendBody;
use crate::engine::seen::{Failure, Locate, ResponseHead};

/// The inner service, as the driver sends copies to it: each copy to a clone of its own, with
/// a body made from the caller's `B`.
pub(super) struct Inner<S, B> {
    service: Arc<S>,
    body: std::marker::PhantomData<fn() -> B>,
}

impl<S, B> Inner<S, B> {
    /// The inner service, shared by the clones of the layer's service.
    pub(super) fn new(service: Arc<S>) -> Self {
        Inner {
            service,
            body: std::marker::PhantomData,
        }
    }
}

/// A request of the tower door, as the driver keeps and copies it: an `http::Request` whose
/// body is a [`SendBody`], copied for another attempt when that body is whole in memory (its
/// bytes cloned by reference count).
impl<B: Send + 'static> Outgoing for http::Request<SendBody<B>> {
    fn method(&self) -> &http::Method {
        http::Request::method(self)
    }

    fn headers(&self) -> &http::HeaderMap {
        http::Request::headers(self)
    }

    fn headers_mut(&mut self) -> &mut http::HeaderMap {
        http::Request::headers_mut(self)
    }

    fn whole_body(&self) -> bool {
        self.body().as_bytes().is_some()
    }

    /// A copy without the extensions: the driver keeps them, and hands each copy its own.
    fn try_clone(&self) -> Option<Self> {
        beneath_service::copy_of(self)
    }

    /// The request itself, a copy kept in its place: the request's headers have room for what
    /// the client beneath adds (a `host`), a copy's would grow.
    fn copy_to_send(&mut self) -> Option<Self> {
        let copy = beneath_service::copy_of(self)?;
        Some(std::mem::replace(self, copy))
    }

    fn locate(&self) -> &dyn Locate {
        http::Request::uri(self)
    }

    fn address(&self) -> Address<'_> {
        crate::driver::claim::address_of(http::Request::uri(self))
    }

    fn uri(&self) -> http::Uri {
        http::Request::uri(self).clone()
    }

    /// Of the URL's text as `Url::as_str` writes it, read from the URI's parts in place.
    fn fingerprint(&self) -> u64 {
        crate::driver::uri::fingerprint(self.method(), http::Request::uri(self))
    }

    type Gone = http::Uri;

    fn gone(&self) -> http::Uri {
        http::Request::uri(self).clone()
    }

    /// Parsed only for the error of a request that gives up.
    fn url_of(gone: &http::Uri) -> Option<url::Url> {
        url::Url::parse(&gone.to_string()).ok()
    }
}

impl<S, B, R> Beneath for Inner<S, B>
where
    S: Service<http::Request<SendBody<B>>, Response = http::Response<R>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Send + 'static,
    R: http_body::Body + Unpin + Send + 'static,
    R::Data: Into<Bytes>,
    R::Error: Into<BoxError>,
{
    type Request = http::Request<SendBody<B>>;
    type Reply = http::Response<RetryBody<R>>;
    /// The inner service's error, boxed as tower passes errors.
    type Error = BoxError;

    /// The inner service's call, held as it is.
    type Running<'s>
        = Call<S, Self::Request, S::Future>
    where
        Self: 's;

    /// A clone of the inner service, asked with the request's own waker until it is ready.
    type Ready = S;

    fn poll_ready(&self, ready: &mut Option<S>, cx: &mut Context<'_>) -> Poll<bool> {
        beneath_service::poll_clone_ready::<S, Self::Request>(&self.service, ready, cx)
    }

    fn run_ready<'s>(
        &'s self,
        mut ready: S,
        request: Self::Request,
        extensions: &'s mut Extensions,
    ) -> Self::Running<'s> {
        Call::Called {
            call: ready.call(marked(request, extensions)),
        }
    }

    fn run<'s>(
        &'s self,
        request: Self::Request,
        extensions: &'s mut Extensions,
    ) -> Self::Running<'s> {
        let mut service = S::clone(&self.service);
        let request = marked(request, extensions);
        // Most services are ready at once (a client's pool takes any number of requests): then
        // the copy is handed over here, under the claim's mark like the rest of the attempt,
        // and only the call's own future is held. One that is not is asked again, by the
        // attempt's task, before the copy goes.
        let mut asking = Context::from_waker(std::task::Waker::noop());
        match service.poll_ready(&mut asking) {
            Poll::Ready(Ok(())) => Call::Called {
                call: service.call(request),
            },
            Poll::Ready(Err(e)) => Call::Failed {
                error: Some(e.into()),
            },
            Poll::Pending => Call::Waiting {
                waiting: Box::new((service, Some(request))),
            },
        }
    }

    /// An answer came from where its request went (`to`): the inner service's answer does not
    /// say.
    fn head<'o>(&'o self, reply: &'o Self::Reply, to: &'o dyn Locate) -> ResponseHead<'o> {
        ResponseHead {
            status: reply.status(),
            version: reply.version(),
            headers: reply.headers(),
            from: to,
        }
    }

    /// The inner service's own error, judged by its causes, for the classifier to look into.
    fn failure<'o>(&'o self, err: &'o BoxError) -> Failure<'o> {
        Failure {
            fault: service_fault(err),
            error: &**err,
        }
    }
}

/// The copy as the inner service takes it: the request's extensions, with the mark that tells
/// an instance further in to pass it through.
fn marked<B>(mut request: http::Request<B>, extensions: &Extensions) -> http::Request<B> {
    *request.extensions_mut() = extensions.clone();
    request.extensions_mut().insert(Claimed);
    request
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::Full;

    #[test]
    fn the_request_itself_is_sent_and_a_copy_kept_in_its_place() {
        let mut request: http::Request<SendBody<Full<Bytes>>> =
            http::Request::new(SendBody::whole(Bytes::from_static(b"order")));
        *request.uri_mut() = "http://127.0.0.1:1/orders".parse().unwrap();
        request
            .headers_mut()
            .insert("x-order", "7".parse().unwrap());
        // What tells the request itself from a copy: a copy has no extensions.
        request.extensions_mut().insert("the request itself");
        let sent = request.copy_to_send().expect("whole");
        assert_eq!(sent.extensions().get(), Some(&"the request itself"));
        assert_eq!(request.extensions().get::<&str>(), None);
        assert_eq!(request.headers()["x-order"], "7");
        assert_eq!(request.uri(), "http://127.0.0.1:1/orders");
        assert_eq!(request.body().as_bytes().unwrap().as_ref(), b"order");
        assert!(request.whole_body());
    }
}
