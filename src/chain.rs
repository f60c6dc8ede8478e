//! Running the rest of the chain for one copy of a request: the request marked as claimed while
//! it runs, in the request's span.
//!
//! # One layer retries
//!
//! Three layers that each retry three times turn one request into twenty-seven, and a layer
//! whose attempt timeout is shorter than an inner layer's whole loop would retry that loop. So
//! the first instance to see a request (the outermost) marks it as its own while it runs the
//! rest of the chain, and every instance further in that finds the mark passes the request
//! through untouched: one layer retries, whatever the timing, and it can tell the others before
//! anything is sent. The mark is a thread-local holding the address of the request's
//! extensions (see `Claiming`): no allocation, unlike a mark in the extensions themselves, and
//! sound because the rest of a chain cannot leave the task that polls it (`Next` borrows the
//! extensions). The limit: only instances of this crate know each other; retries made by
//! another library in the same chain are not seen.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::Next;

/// What lies beneath the driver: where each copy of a request goes, with the request's
/// extensions. The rest of a `reqwest-middleware` chain, or a tower service (`tower`): the one
/// thing the two front doors do differently while a request is driven.
pub(crate) trait Beneath: Send + Sync {
    /// Sends `request` on, with `extensions`.
    fn run<'s>(
        &'s self,
        request: Request,
        extensions: &'s mut Extensions,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<Response>> + Send + 's>>;
}

impl Beneath for Next<'_> {
    #[inline]
    fn run<'s>(
        &'s self,
        request: Request,
        extensions: &'s mut Extensions,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<Response>> + Send + 's>> {
        self.clone().run(request, extensions)
    }
}

/// Tells the middleware and transport beneath which attempt this is, before they see it (a first
/// attempt carries nothing: [`RetryAttempt::of`](crate::RetryAttempt::of) reads its absence).
#[inline]
pub(crate) fn announce(extensions: &mut Extensions, span: &tracing::Span, number: u32) {
    if number > 1 {
        extensions.insert(crate::observe::RetryAttempt { number });
        span.record("http.request.resend_count", number - 1);
    }
}

/// Whether an instance further out on this request's path already makes its attempts.
pub(crate) fn claimed(extensions: &Extensions) -> bool {
    CLAIMED.get() == claim_id(extensions)
}

thread_local! {
    /// Which request's chain is being run on this thread, if any: the address of its
    /// extensions, set by the instance that makes its attempts while it runs the rest of the
    /// chain (0: none).
    static CLAIMED: Cell<usize> = const { Cell::new(0) };
}

/// What identifies a request's passage through the chain: every middleware of it is handed the
/// same extensions, which stay at one address while the request is in the chain, and a
/// middleware's future cannot move the rest of the chain to another task (it borrows them).
pub(crate) fn claim_id(extensions: &Extensions) -> usize {
    std::ptr::from_ref(extensions) as usize
}

/// The rest of the chain for one attempt, run with its request marked as claimed on the
/// thread, so that instances nearer the transport pass it through instead of retrying it again.
/// Costs no allocation, unlike a mark in the extensions; the mark is the extensions' address,
/// so a request that a middleware of the chain makes of its own (a token refresh, say) through
/// another client is not mistaken for this one.
///
/// The logical request's span is entered for as long as the rest of the chain runs, so the
/// spans and events of the middleware and transport beneath are its children.
pub(crate) struct Claiming<'s, F> {
    id: usize,
    span: &'s tracing::Span,
    run: F,
}

impl<'s, F> Claiming<'s, F> {
    /// Starts the rest of the chain (`start`) with the request already marked: a middleware may
    /// do work before its future is first polled.
    #[inline]
    pub(crate) fn new(id: usize, span: &'s tracing::Span, start: impl FnOnce() -> F) -> Self {
        let _marked = Mark::set(id);
        let run = span.in_scope(start);
        Claiming { id, span, run }
    }
}

impl<F: Future + Unpin> Future for Claiming<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        let _marked = Mark::set(self.id);
        if self.span.is_disabled() {
            return Pin::new(&mut self.run).poll(cx);
        }
        let _entered = self.span.enter();
        Pin::new(&mut self.run).poll(cx)
    }
}

/// Marks a request as claimed until dropped, then puts back the mark it replaced (a chain may
/// run inside another's, for a request of its own).
struct Mark(usize);

impl Mark {
    fn set(id: usize) -> Mark {
        Mark(CLAIMED.replace(id))
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        CLAIMED.set(self.0);
    }
}

/// The error of an attempt that ran out of its time.
pub(crate) fn timed_out(limit: Duration) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(crate::error::AttemptTimeout { after: limit })
}
