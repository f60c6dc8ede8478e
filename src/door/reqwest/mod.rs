//! The first front door: [`RetryMiddleware`] in a `reqwest-middleware` chain. Each copy of a
//! request goes down the rest of the chain (`Next`) as the `reqwest::Request` it is. Its answers
//! and errors differ by platform: outside the browser (`native`) an answer's body is read and
//! the answer rebuilt around it, and an error says what the socket did; in a page (`browser`,
//! wasm32, reqwest over `fetch`) neither is possible.

mod errors;

pub use errors::RetryErrorExt;

#[cfg(target_arch = "wasm32")]
mod browser;
#[cfg(not(target_arch = "wasm32"))]
mod native;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use std::task::Poll;

use crate::driver::claim::{self, Address, Beneath, Outgoing};
use crate::driver::middleware::RetryMiddleware;
use crate::engine::seen::{Failure, Locate, ResponseHead};
use crate::fault::Fault;
use crate::maybe_send::BoxFuture;
#[cfg(target_arch = "wasm32")]
use browser::reqwest_fault;
#[cfg(not(target_arch = "wasm32"))]
use native::read_at_hand;
#[cfg(not(target_arch = "wasm32"))]
use native::reqwest_fault;

// Not `async_trait`, whose future would hold the request twice more and box this one inside its
// own: the logical request's future alone is boxed, and a request passed through costs none.
impl Middleware for RetryMiddleware {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        #[cfg_attr(target_arch = "wasm32", allow(unused_mut))] mut request: Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> BoxFuture<'async_trait, reqwest_middleware::Result<Response>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        if claim::claimed(extensions, &request) {
            // An instance further out on this request's path makes the attempts and retries.
            return next.run(request, extensions);
        }
        // In place: a request moved to a binding of its own is copied (about 250 bytes).
        #[cfg(not(target_arch = "wasm32"))]
        read_at_hand(&mut request);
        // Written into its place as it is made, not made beside it and copied there.
        let place = Box::new_uninit();
        let run = RetryMiddleware::execute(self, request, extensions, next);
        let run: Box<_> = Box::write(place, run);
        Box::into_pin(run)
    }
}

impl Beneath for Next<'_> {
    type Request = Request;
    type Reply = Response;
    type Error = reqwest_middleware::Error;

    /// The chain's own future, boxed by the chain.
    type Running<'s>
        = BoxFuture<'s, reqwest_middleware::Result<Response>>
    where
        Self: 's;

    #[inline]
    fn run<'s>(&'s self, request: Request, extensions: &'s mut Extensions) -> Self::Running<'s> {
        self.clone().run(request, extensions)
    }

    /// A chain takes every copy at once.
    type Ready = ();

    fn poll_ready(&self, ready: &mut Option<()>, _: &mut std::task::Context<'_>) -> Poll<bool> {
        *ready = Some(());
        Poll::Ready(true)
    }

    fn run_ready<'s>(
        &'s self,
        (): (),
        request: Request,
        extensions: &'s mut Extensions,
    ) -> Self::Running<'s> {
        self.clone().run(request, extensions)
    }

    /// An answer says where it came from (its URL, after any redirect).
    #[inline]
    fn head<'o>(&'o self, reply: &'o Response, _: &'o dyn Locate) -> ResponseHead<'o> {
        head(reply)
    }

    #[inline]
    fn failure<'o>(&'o self, err: &'o reqwest_middleware::Error) -> Failure<'o> {
        failure(err)
    }
}

impl Outgoing for Request {
    fn method(&self) -> &http::Method {
        Request::method(self)
    }

    fn headers(&self) -> &http::HeaderMap {
        Request::headers(self)
    }

    fn headers_mut(&mut self) -> &mut http::HeaderMap {
        Request::headers_mut(self)
    }

    fn whole_body(&self) -> bool {
        self.body().is_none_or(|body| body.as_bytes().is_some())
    }

    fn try_clone(&self) -> Option<Self> {
        Request::try_clone(self)
    }

    fn locate(&self) -> &dyn Locate {
        self.url()
    }

    fn address(&self) -> Address<'_> {
        let url = self.url();
        Address {
            scheme: url.scheme(),
            host: url.host_str().unwrap_or(""),
            port: url.port(),
            known_port: url.port_or_known_default(),
            path: url.path(),
        }
    }

    /// Its URL as a URI (a URI a request carries has no fragment).
    fn uri(&self) -> http::Uri {
        let url = self.url().as_str();
        let without_fragment = url.split_once('#').map_or(url, |(uri, _)| uri);
        without_fragment.parse().unwrap_or_default()
    }

    /// Of the URL's text up to its fragment, which is never sent.
    fn fingerprint(&self) -> u64 {
        let text = self.url().as_str();
        // The fragment is a slice of the text, after its `#`.
        let at = |part: &str| (part.as_ptr() as usize).saturating_sub(text.as_ptr() as usize);
        let end = self
            .url()
            .fragment()
            .map_or(text.len(), |fragment| at(fragment).saturating_sub(1));
        claim::fingerprint_of(
            self.method(),
            text.as_bytes().get(..end).unwrap_or_default(),
        )
    }

    type Gone = reqwest::Url;

    fn gone(&self) -> reqwest::Url {
        self.url().clone()
    }

    fn url_of(gone: &reqwest::Url) -> Option<reqwest::Url> {
        Some(gone.clone())
    }
}

/// What the engine reads of an answer of this door: its head, and where it came from.
#[inline]
pub(crate) fn head(response: &Response) -> ResponseHead<'_> {
    ResponseHead {
        status: response.status(),
        #[cfg(not(target_arch = "wasm32"))]
        version: response.version(),
        // A page cannot see the version `fetch` spoke.
        #[cfg(target_arch = "wasm32")]
        version: http::Version::HTTP_11,
        headers: response.headers(),
        from: response.url(),
    }
}

/// What the engine reads of an error of this door: its transient fault, and the error itself
/// for a classifier (reqwest's own, or another middleware's).
pub(crate) fn failure(err: &reqwest_middleware::Error) -> Failure<'_> {
    Failure {
        fault: transport_fault(err),
        error: match err {
            reqwest_middleware::Error::Reqwest(e) => e,
            reqwest_middleware::Error::Middleware(e) => e.as_ref(),
        },
    }
}

/// The transient fault behind `err`, or `None` when the error is permanent: reqwest's own
/// error by what it says of itself and its causes, and never another middleware's error (one
/// from an inner instance of ours that has already given up included): not ours to repeat.
pub(crate) fn transport_fault(err: &reqwest_middleware::Error) -> Option<Fault> {
    match err {
        reqwest_middleware::Error::Middleware(_) => None,
        reqwest_middleware::Error::Reqwest(e) => reqwest_fault(e),
    }
}

/// The reqwest door's answer: its record is in its extensions. Not in the browser, where
/// reqwest's answer has no extensions: there `RetryRecord::of` does not take one, rather than
/// read every answer as a first attempt's.
#[cfg(not(target_arch = "wasm32"))]
impl crate::record::Answer for Response {
    fn parts(&self) -> (bool, &Extensions) {
        (self.status().as_u16() >= 400, self.extensions())
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl crate::record::sealed::Sealed for Response {}
