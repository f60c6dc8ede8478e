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
use std::task::{Context, Poll};

use std::time::Duration;

use http::Extensions;
use http::{HeaderMap, Method};

use crate::driver::body::{Outcome, Reply};
use crate::engine::seen::{Failure, Locate, ResponseHead, Seen};
use crate::error::{AttemptTimeout, DoorError, LastError};
use crate::maybe_send::{MaybeSend, MaybeSync};
use crate::stop::StopReason;

/// What lies beneath the driver: where each copy of a request goes, with the request's
/// extensions. The rest of a `reqwest-middleware` chain, or a tower service (`tower`): the one
/// thing the two front doors do differently while a request is driven.
pub(crate) trait Beneath: MaybeSend + MaybeSync {
    /// A request as this door takes it.
    type Request: Outgoing;
    /// An answer as this door hands it back.
    type Reply: Reply<Error = Self::Error>;

    /// The error a copy may end in: the chain's, or the inner service's; also what the
    /// answer's body ends in when it fails.
    type Error: DoorError;

    /// A copy on its way: the door's own future, held in the attempt as it is (not boxed).
    type Running<'s>: Future<Output = Result<Self::Reply, Self::Error>> + MaybeSend + 's
    where
        Self: 's;

    /// Sends `request` on, with `extensions`.
    fn run<'s>(
        &'s self,
        request: Self::Request,
        extensions: &'s mut Extensions,
    ) -> Self::Running<'s>;

    /// What a copy is handed to once the door is ready to take it (a tower service that said
    /// it is ready; nothing, for a chain, which takes every copy at once).
    type Ready: MaybeSend;

    /// Whether the door is ready to take a hedge's copy, asked before the hedge is decided and
    /// paid for: a copy that would wait for readiness is no hedge yet. `ready` keeps what was
    /// made ready between polls. `Ready(false)`: the door failed to become ready, and no hedge
    /// goes.
    fn poll_ready(&self, ready: &mut Option<Self::Ready>, cx: &mut Context<'_>) -> Poll<bool>;

    /// Sends `request` on, with `extensions`, to what [`poll_ready`](Self::poll_ready) made
    /// ready.
    fn run_ready<'s>(
        &'s self,
        ready: Self::Ready,
        request: Self::Request,
        extensions: &'s mut Extensions,
    ) -> Self::Running<'s>;

    /// An answer's head as the engine reads it. `to`: where the request went, for a door
    /// whose answers do not say where they came from.
    fn head<'o>(&'o self, reply: &'o Self::Reply, to: &'o dyn Locate) -> ResponseHead<'o>;

    /// An error of this door as the engine reads it: the transient fault the door finds in
    /// it, and the error itself, for a classifier.
    fn failure<'o>(&'o self, err: &'o Self::Error) -> Failure<'o>;

    /// What a first attempt's answer that ends the request stands for when it carries no
    /// record (`RetryRecord::of` infers it): an HTTP success, or, behind the gRPC door, a
    /// committed call. The driver spares such an answer its record.
    fn answered(&self) -> StopReason {
        StopReason::Succeeded
    }

    /// An attempt's outcome as the engine reads it: the answer's head, or the error with its
    /// transient fault: the door's, as the door finds it; the layer's own, as it says
    /// (its attempt timeout is transient, a request not sent is not).
    #[inline]
    fn seen<'o>(&'o self, outcome: &'o Outcome<Self::Reply>, to: &'o dyn Locate) -> Seen<'o> {
        seen_of(outcome, |reply| self.head(reply, to), |e| self.failure(e))
    }
}

/// An attempt's outcome as the engine reads it: an answer by its `head`, an error of the door
/// by its `failure`, one of the layer's own as it says.
#[inline]
pub(crate) fn seen_of<'o, R: Reply>(
    outcome: &'o Outcome<R>,
    head: impl FnOnce(&'o R) -> ResponseHead<'o>,
    failure: impl FnOnce(&'o R::Error) -> Failure<'o>,
) -> Seen<'o> {
    match outcome {
        Ok(reply) => Seen::Answer(head(reply)),
        Err(LastError::Beneath(e)) => Seen::Failed(failure(e)),
        Err(own) => Seen::Failed(Failure {
            fault: own.own_fault(),
            error: own.as_error(),
        }),
    }
}

/// A request as a door hands it to the driver: its head, a copy of it for another attempt, and
/// where it goes. A `reqwest::Request` behind the reqwest door, an `http::Request` behind the
/// tower door: neither is made into the other.
pub(crate) trait Outgoing: MaybeSend + Sized + 'static {
    /// The request's method.
    fn method(&self) -> &Method;
    /// The request's headers.
    fn headers(&self) -> &HeaderMap;
    /// The request's headers, for the key and the attempt headers a copy carries.
    fn headers_mut(&mut self) -> &mut HeaderMap;
    /// Whether its body, if any, is whole in memory and can be sent twice.
    fn whole_body(&self) -> bool;
    /// A copy for another attempt, unless its body can be sent only once.
    fn try_clone(&self) -> Option<Self>;
    /// A request to send while one stays kept for another attempt, unless its body can be sent
    /// only once: a copy, or the request itself with a copy kept in its place where that costs
    /// less (a copy's headers are made to measure, and a transport that adds one grows them).
    fn copy_to_send(&mut self) -> Option<Self> {
        self.try_clone()
    }
    /// Where it goes, for a rule that asks (a route, a quota).
    fn locate(&self) -> &dyn Locate;
    /// Where it goes, in the parts the trace, the observer and the claim name it by.
    fn address(&self) -> Address<'_>;
    /// Its URI, for a classifier to see.
    fn uri(&self) -> http::Uri;
    /// What identifies it across the doors: [`fingerprint_of`] its method and its URL's text.
    fn fingerprint(&self) -> u64;
    /// What is kept of it once its last copy went: where it went, for the error of a request
    /// that gives up and the head of its last answer.
    type Gone: Locate + Send + Sync;
    /// What is kept of it once its last copy went.
    fn gone(&self) -> Self::Gone;
    /// The URL of a request that went, for its error (the only caller: a give-up).
    fn url_of(gone: &Self::Gone) -> Option<url::Url>;
}

/// Where a request goes, in parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Address<'a> {
    pub(crate) scheme: &'a str,
    pub(crate) host: &'a str,
    /// The port as written, unless it is the scheme's own.
    pub(crate) port: Option<u16>,
    /// The port as written, else the scheme's own.
    pub(crate) known_port: Option<u16>,
    pub(crate) path: &'a str,
}

/// Where `uri` goes, in the parts the trace, the observer and the claim name it by: the scheme's
/// own port left out, an empty path read as `/`.
#[cfg(any(feature = "tower", feature = "grpc"))]
pub(crate) fn address_of(uri: &http::Uri) -> Address<'_> {
    let scheme = uri.scheme_str().unwrap_or("");
    let known = match scheme {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    };
    let (host, written) = uri.authority().map_or(("", None), |authority| {
        crate::engine::seen::split_authority(authority.as_str())
    });
    let path = match uri.path() {
        "" => "/",
        path => path,
    };
    Address {
        scheme,
        host,
        port: written.filter(|port| Some(*port) != known),
        known_port: written.or(known),
        path,
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

/// The mark each copy that the tower or gRPC door sends carries in its extensions: an instance
/// further in, of either door, passes the request through. It crosses a task (a `Buffer`
/// between the layers) where the thread's mark cannot.
#[cfg(any(feature = "tower", feature = "grpc"))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claimed;

/// Whether an instance further out on this request's path already makes its attempts: the
/// mark on the thread is this request's passage through the chain (the same extensions), or,
/// across the two doors, the same request (its method and URL), which a service or middleware
/// between them carried from one door's types to the other's.
#[inline]
pub(crate) fn claimed(extensions: &Extensions, request: &impl Outgoing) -> bool {
    let (id, print) = CLAIMED.get();
    id != 0 && (id == claim_id(extensions) || print == fingerprint(request))
}

thread_local! {
    /// Which request's chain is being run on this thread, if any: the address of its
    /// extensions and its fingerprint, set by the instance that makes its attempts while it
    /// runs the rest of the chain ((0, 0): none).
    static CLAIMED: Cell<(usize, u64)> = const { Cell::new((0, 0)) };
}

/// What identifies a request's passage through the chain: every middleware of it is handed the
/// same extensions, which stay at one address while the request is in the chain, and a
/// middleware's future cannot move the rest of the chain to another task (it borrows them).
pub(crate) fn claim_id(extensions: &Extensions) -> usize {
    std::ptr::from_ref(extensions) as usize
}

/// What identifies a request across the doors, where its extensions are another map: its
/// method and URL, hashed once per logical request, eight bytes at a step. A request of another
/// method or URL that a service between the doors makes of its own (a token fetch) is retried by
/// its own instance; one of the same method and URL is taken for the request itself and passed
/// through.
pub(crate) fn fingerprint(request: &impl Outgoing) -> u64 {
    request.fingerprint()
}

/// The fingerprint of a request of `method` to the URL whose text is `url`
/// (`scheme://host[:port]/path[?query]`, as `Url::as_str` writes it, without a fragment), which
/// each door gives.
pub(crate) fn fingerprint_of(method: &Method, url: &[u8]) -> u64 {
    let hash = fold(0x243f_6a88_85a3_08d3, method.as_str().as_bytes());
    // Never the "none" mark's value.
    fold(hash, url).max(1)
}

/// `hash` and `word` mixed.
fn mix(hash: u64, word: u64) -> u64 {
    (hash ^ word)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .rotate_left(29)
}

/// `hash` with `bytes` folded in, their length first (so where one part ends and the next
/// begins counts), then eight bytes at a step; a tail shorter than eight is the last eight
/// bytes, overlapping the step before (no copy), or, when there are fewer, read as two
/// overlapping halves (four to seven bytes) or its first, middle and last byte (one to three),
/// which, with the length, is every byte.
fn fold(hash: u64, bytes: &[u8]) -> u64 {
    let four = |at: usize| {
        bytes.get(at..at + 4).map_or(0, |four| {
            u64::from(u32::from_le_bytes(four.try_into().unwrap_or([0; 4])))
        })
    };
    let word = |eight: &[u8]| u64::from_le_bytes(eight.try_into().unwrap_or([0; 8]));
    let mut hash = mix(hash, bytes.len() as u64);
    let mut words = bytes.chunks_exact(8);
    for eight in &mut words {
        hash = mix(hash, word(eight));
    }
    let (len, tail) = (bytes.len(), words.remainder());
    if !tail.is_empty() {
        let last = match len {
            8.. => word(&bytes[len - 8..]),
            4.. => four(0) | four(len - 4) << 32,
            _ => {
                let byte = |at: usize| u64::from(bytes.get(at).copied().unwrap_or(0));
                byte(0) << 16 | byte(len / 2) << 8 | byte(len - 1)
            }
        };
        hash = mix(hash, last);
    }
    hash
}

pin_project_lite::pin_project! {
    /// The rest of the chain for one attempt, run with its request marked as claimed on the
    /// thread, so that instances nearer the transport pass it through instead of retrying it again.
    /// Costs no allocation, unlike a mark in the extensions; the mark is the extensions' address,
    /// so a request that a middleware of the chain makes of its own (a token refresh, say) through
    /// another client is not mistaken for this one.
    ///
    /// The logical request's span is entered for as long as the rest of the chain runs, so the
    /// spans and events of the middleware and transport beneath are its children.
    pub(crate) struct Claiming<'s, F> {
        id: (usize, u64),
        span: &'s tracing::Span,
        #[pin]
        run: F,
    }
}

impl<'s, F> Claiming<'s, F> {
    /// Starts the rest of the chain (`start`) with the request already marked: a middleware may
    /// do work before its future is first polled.
    #[inline]
    pub(crate) fn new(
        id: (usize, u64),
        span: &'s tracing::Span,
        start: impl FnOnce() -> F,
    ) -> Self {
        let _marked = Mark::set(id);
        let run = span.in_scope(start);
        Claiming { id, span, run }
    }
}

impl<F: Future> Future for Claiming<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let _marked = Mark::set(*this.id);
        if this.span.is_disabled() {
            return this.run.poll(cx);
        }
        let _entered = this.span.enter();
        this.run.poll(cx)
    }
}

/// Marks a request as claimed until dropped, then puts back the mark it replaced (a chain may
/// run inside another's, for a request of its own).
struct Mark((usize, u64));

impl Mark {
    fn set(id: (usize, u64)) -> Mark {
        Mark(CLAIMED.replace(id))
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        CLAIMED.set(self.0);
    }
}

/// The error of an attempt that ran out of its time.
pub(crate) fn timed_out<E>(limit: Duration) -> LastError<E> {
    LastError::TimedOut(AttemptTimeout { after: limit })
}

#[cfg(test)]
mod tests {
    use reqwest::Request;

    use super::*;

    fn request(method: &str, url: &str) -> Request {
        Request::new(method.parse().unwrap(), url.parse().unwrap())
    }

    #[test]
    fn a_request_is_known_across_the_doors_by_its_method_and_url() {
        let get = fingerprint(&request("GET", "http://127.0.0.1:8080/orders?id=7"));
        assert_eq!(
            get,
            fingerprint(&request("GET", "http://127.0.0.1:8080/orders?id=7"))
        );
        for (method, url) in [
            ("PUT", "http://127.0.0.1:8080/orders?id=7"),
            ("POST", "http://127.0.0.1:8080/orders?id=7"),
            ("GET", "http://127.0.0.1:8080/orders?id=8"),
            ("GET", "http://127.0.0.1:8081/orders?id=7"),
            ("GE", "Thttp://127.0.0.1:8080/orders?id=7"),
            ("GET", "http://127.0.0.1:8080/orders?id=7?"),
            ("GET", "http://127.0.0.1:8080/orders/?id=7"),
            ("GET", "http://127.0.0.1:8080/orders"),
        ] {
            assert_ne!(get, fingerprint(&request(method, url)), "{method} {url}");
        }
        // No query, and an empty one, are told apart; a fragment is not sent, and not counted.
        let bare = fingerprint(&request("GET", "http://127.0.0.1/orders"));
        assert_ne!(
            bare,
            fingerprint(&request("GET", "http://127.0.0.1/orders?"))
        );
        assert_eq!(
            bare,
            fingerprint(&request("GET", "http://127.0.0.1/orders#top"))
        );
    }

    proptest::proptest! {
        /// Two requests that differ in method or URL are told apart, whatever their lengths
        /// (the tail of each part, and where one part ends and the next begins, count).
        #[test]
        fn requests_that_differ_have_different_fingerprints(
            a in ("GET|POST|PUT", "[a-z0-9/?=&.-]{0,40}"),
            b in ("GET|POST|PUT", "[a-z0-9/?=&.-]{0,40}"),
        ) {
            let url = |path: &str| format!("http://127.0.0.1:8080/{path}");
            let (first, second) = (request(&a.0, &url(&a.1)), request(&b.0, &url(&b.1)));
            let same = first.method() == second.method() && first.url() == second.url();
            proptest::prop_assert_eq!(fingerprint(&first) == fingerprint(&second), same);
        }
    }

    /// URLs one character apart, at every position of a long one (whole words of eight and
    /// the tail), all hash apart: each byte reaches the hash.
    #[test]
    fn every_byte_of_the_url_counts() {
        let base = "http://127.0.0.1:8080/orders/00000000000000000000?id=0000";
        let mut seen = std::collections::HashSet::new();
        let mut urls = 0;
        for at in base.find("/orders").unwrap() + 1..base.len() {
            if !base.as_bytes()[at].is_ascii_alphanumeric() {
                continue;
            }
            for digit in b'1'..=b'9' {
                let mut url = base.as_bytes().to_vec();
                url[at] = digit;
                let url = String::from_utf8(url).unwrap();
                seen.insert(fingerprint(&request("GET", &url)));
                urls += 1;
            }
        }
        assert_eq!(
            seen.len(),
            urls,
            "{} of {urls} fingerprints apart",
            seen.len()
        );
    }

    /// Parts of every length up to three words, one byte apart at every position (whole words,
    /// the overlapping last word, the two halves, the first, middle and last byte), all fold
    /// apart, and apart from the same part one byte shorter: each byte and the length count.
    #[test]
    fn every_byte_of_a_part_of_any_length_counts() {
        let mut seen = std::collections::HashSet::new();
        let mut parts = 0;
        for len in 1..=24 {
            let base: Vec<u8> = (0..len).map(|at| b'a' + (at % 26) as u8).collect();
            assert!(seen.insert(fold(7, &base)), "length {len}");
            parts += 1;
            for at in 0..len {
                for byte in [0x00, 0x7f, 0xff] {
                    let mut part = base.clone();
                    part[at] = byte;
                    assert!(
                        seen.insert(fold(7, &part)),
                        "length {len}, byte {at} = {byte}"
                    );
                    parts += 1;
                }
            }
        }
        assert_eq!(seen.len(), parts);
    }

    #[test]
    fn only_the_marked_request_or_its_passage_is_claimed() {
        let (mine, other) = (Extensions::new(), Extensions::new());
        let orders = request("GET", "http://127.0.0.1/orders");
        let token = request("POST", "http://127.0.0.1/token");
        assert!(!claimed(&mine, &orders), "nothing is marked");
        let _marked = Mark::set((claim_id(&mine), fingerprint(&orders)));
        assert!(claimed(&mine, &token), "the same passage");
        assert!(
            claimed(&other, &orders),
            "the same request behind the other door"
        );
        assert!(!claimed(&other, &token), "a request of its own");
    }
}
