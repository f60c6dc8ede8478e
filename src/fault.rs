//! What went wrong with an attempt that got no answer, whatever the client: a door-neutral
//! fault, derived by each door from its own errors, and read by the engine (is it transient, is
//! it certain that nothing was sent) and by the errors the crate hands back.
//!
//! Transport errors are recognised by what they are made of (timeouts, `std::io` error kinds,
//! hyper's "incomplete message", HTTP/2 reasons), not by their text, so a new wording in a
//! dependency cannot change a decision. The one exception is a failed name resolution, which
//! hyper's connector reports only by its message.

// A page's `fetch` reports no socket's errors (see the reqwest door's `browser::reqwest_fault`):
// the causes read here, and HTTP/2's refusals, are never met in the browser.
#![cfg_attr(target_arch = "wasm32", allow(dead_code))]

use std::io;

/// A transport failure worth another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The attempt timed out (connecting, waiting for the head, or reading a buffered body).
    Timeout,
    /// Connecting failed for a transient reason: no byte of the request reached the server.
    Connect,
    /// The connection was reset, aborted or broken after it was established.
    Reset,
    /// The server closed the connection before the response was complete.
    Incomplete,
    /// The request was not processed: an HTTP/2 stream refused with REFUSED_STREAM, or above
    /// the last stream id of a graceful GOAWAY (feature `http2`), or a connection that closed
    /// before the request was handed to it (hyper's "channel closed").
    NotProcessed,
}

impl Fault {
    pub(crate) fn as_str(self) -> &'static str {
        self.kind().as_str()
    }

    /// The public name of this kind of fault.
    pub(crate) fn kind(self) -> AttemptErrorKind {
        use AttemptErrorKind as Kind;
        match self {
            Fault::Timeout => Kind::Timeout,
            Fault::Connect => Kind::Connect,
            Fault::Reset => Kind::Reset,
            Fault::Incomplete => Kind::Incomplete,
            Fault::NotProcessed => Kind::NotProcessed,
        }
    }

    /// Whether the request certainly had no effect: no byte of it reached the server, or the
    /// server said it did not process it.
    pub(crate) fn nothing_sent(self) -> bool {
        matches!(self, Fault::Connect | Fault::NotProcessed)
    }
}

/// What kind of error an attempt ended in, as the default rules read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttemptErrorKind {
    /// The attempt timed out: the policy's per-attempt timeout, or the client's or request's.
    Timeout,
    /// Connecting failed for a reason that may pass; nothing of the request was sent.
    Connect,
    /// The connection was reset, aborted or broken after it was made.
    Reset,
    /// The server closed the connection before the response was complete.
    Incomplete,
    /// The server said it did not process the request (HTTP/2 REFUSED_STREAM, or above a
    /// graceful GOAWAY's last stream).
    NotProcessed,
    /// An error that repeating would not change (TLS, a builder or redirect error, another
    /// middleware's error), unless the dependency's classifier said otherwise.
    Permanent,
}

impl AttemptErrorKind {
    /// A short, stable, lowercase name, as the `error` field of the tracing events has it.
    pub fn as_str(&self) -> &'static str {
        match self {
            AttemptErrorKind::Timeout => "timeout",
            AttemptErrorKind::Connect => "connect",
            AttemptErrorKind::Reset => "reset",
            AttemptErrorKind::Incomplete => "incomplete",
            AttemptErrorKind::NotProcessed => "not_processed",
            AttemptErrorKind::Permanent => "permanent",
        }
    }
}

#[cfg(any(test, feature = "reqwest", feature = "tower"))]
/// What hyper's connector calls the error of a name that could not be resolved, whatever the
/// resolver (the system's, hickory's, or one given to reqwest's `dns_resolver`) said.
const DNS_ERROR: &str = "dns error";

#[cfg(any(test, feature = "reqwest", feature = "tower"))]
/// Whether `err` or one of its sources is a failure to resolve the host name. hyper's
/// connector error is not public, so it is known by its message, written into a fixed buffer
/// (no allocation, and a message of any length is compared in bounded time).
pub(crate) fn resolution_failed(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    // Bounded: no real chain is this deep, and a cycle must not loop for ever.
    for _ in 0..64 {
        let Some(cause) = source else {
            return false;
        };
        if displays_as(cause, DNS_ERROR) {
            return true;
        }
        source = cause.source();
    }
    false
}

#[cfg(any(test, feature = "reqwest", feature = "tower"))]
/// Whether `value` displays exactly as `text`.
fn displays_as(value: &dyn std::fmt::Display, text: &str) -> bool {
    /// Compares what is written with the rest of `text`, and stops at the first difference.
    struct Compare<'t>(&'t str);
    impl std::fmt::Write for Compare<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            match self.0.strip_prefix(s) {
                Some(rest) => {
                    self.0 = rest;
                    Ok(())
                }
                None => Err(std::fmt::Error),
            }
        }
    }
    let mut compare = Compare(text);
    std::fmt::write(&mut compare, format_args!("{value}")).is_ok() && compare.0.is_empty()
}

/// Whether `err` or one of its sources says time ran out: an I/O error of kind `TimedOut`
/// (a connector's connect timeout), or hyper's timeout.
pub(crate) fn timed_out_in(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    // Bounded: no real chain is this deep, and a cycle must not loop for ever.
    for _ in 0..64 {
        let Some(cause) = source else {
            return false;
        };
        let io = cause.downcast_ref::<io::Error>();
        if io.is_some_and(|io| io_fault(io) == Some(Fault::Timeout))
            || cause
                .downcast_ref::<hyper::Error>()
                .is_some_and(hyper::Error::is_timeout)
        {
            return true;
        }
        source = cause.source();
    }
    false
}

/// The first transient cause found in `err` or its sources.
pub(crate) fn of_causes(err: &(dyn std::error::Error + 'static)) -> Option<Fault> {
    let mut source = Some(err);
    // Bounded: no real chain is this deep, and a cycle must not loop for ever.
    for _ in 0..64 {
        let cause = source?;
        if let Some(io) = cause.downcast_ref::<io::Error>() {
            if let Some(fault) = io_fault(io) {
                return Some(fault);
            }
        }
        #[cfg(any(feature = "http2", feature = "grpc"))]
        if let Some(h2) = cause.downcast_ref::<h2::Error>() {
            return h2_fault(h2);
        }
        if let Some(hyper) = cause.downcast_ref::<hyper::Error>() {
            if hyper.is_timeout() {
                return Some(Fault::Timeout);
            }
            if hyper.is_incomplete_message() || hyper.is_canceled() {
                return Some(Fault::Incomplete);
            }
            // The connection had closed before the request was handed to it (an HTTP/2
            // GOAWAY before any stream, an HTTP/1 connection gone while idle): no byte of it
            // was written.
            if hyper.is_closed() {
                return Some(Fault::NotProcessed);
            }
        }
        source = cause.source();
    }
    None
}

/// The transient fault an HTTP/2 error stands for (RFC 9113 §8.7): a stream the server refused,
/// or left above a graceful GOAWAY's last stream id, was not processed and is safe to send again
/// whatever its method; any other reset or connection failure may have come after processing.
/// Errors this side raised itself are not transient.
#[cfg(any(feature = "http2", feature = "grpc"))]
fn h2_fault(err: &h2::Error) -> Option<Fault> {
    if let Some(io) = err.get_io() {
        return io_fault(io).or(Some(Fault::Reset));
    }
    if !err.is_remote() {
        return None;
    }
    match err.reason() {
        Some(h2::Reason::REFUSED_STREAM) if err.is_reset() => Some(Fault::NotProcessed),
        Some(h2::Reason::NO_ERROR) if err.is_go_away() => Some(Fault::NotProcessed),
        Some(_) => Some(Fault::Reset),
        None => None,
    }
}

/// The transient fault an I/O error stands for. An error of another kind may wrap one that is
/// decisive (reqwest's TLS connector wraps a reset during the handshake in an error of kind
/// `Other`), and `io::Error::source` skips the wrapped error itself, so it is looked into here.
fn io_fault(io: &io::Error) -> Option<Fault> {
    let mut io = io;
    for _ in 0..8 {
        match io.kind() {
            io::ErrorKind::TimedOut => return Some(Fault::Timeout),
            io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected => return Some(Fault::Reset),
            io::ErrorKind::UnexpectedEof => return Some(Fault::Incomplete),
            _ => {}
        }
        io = io.get_ref()?.downcast_ref::<io::Error>()?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_compared_whole_however_it_is_written() {
        /// Writes its parts one by one, as a `Display` of several `write!`s does.
        struct Parts(&'static [&'static str]);
        impl std::fmt::Display for Parts {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.iter().try_for_each(|part| f.write_str(part))
            }
        }
        assert!(displays_as(&Parts(&["dns error"]), DNS_ERROR));
        assert!(displays_as(&Parts(&["dns", " ", "error"]), DNS_ERROR));
        assert!(!displays_as(&Parts(&["dns"]), DNS_ERROR), "a prefix");
        assert!(
            !displays_as(&Parts(&["dns error: more"]), DNS_ERROR),
            "longer"
        );
        assert!(
            !displays_as(&Parts(&["dns error", "!"]), DNS_ERROR),
            "longer"
        );
        assert!(!displays_as(&Parts(&["tcp connect error"]), DNS_ERROR));
        assert!(displays_as(&Parts(&[]), ""));
    }

    #[test]
    fn a_resolution_failure_is_found_anywhere_in_the_chain() {
        #[derive(Debug)]
        struct Wrap(&'static str, Option<Box<Wrap>>);
        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let deep = Wrap(
            "client error (Connect)",
            Some(Box::new(Wrap(
                "dns error",
                Some(Box::new(Wrap("no upstream", None))),
            ))),
        );
        assert!(resolution_failed(&deep));
        assert!(resolution_failed(&Wrap("dns error", None)));
        let refused = Wrap(
            "client error (Connect)",
            Some(Box::new(Wrap("tcp connect error", None))),
        );
        assert!(!resolution_failed(&refused));
    }

    #[test]
    fn only_a_connect_fault_guarantees_nothing_was_sent() {
        assert!(Fault::Connect.nothing_sent());
        for f in [Fault::Timeout, Fault::Reset, Fault::Incomplete] {
            assert!(!f.nothing_sent(), "{f:?}");
        }
    }

    fn io(kind: io::ErrorKind, text: &str) -> io::Error {
        io::Error::new(kind, text.to_owned())
    }

    #[test]
    fn passing_socket_failures_are_transient() {
        for (kind, fault) in [
            (io::ErrorKind::ConnectionRefused, Fault::Reset),
            (io::ErrorKind::ConnectionReset, Fault::Reset),
            (io::ErrorKind::ConnectionAborted, Fault::Reset),
            (io::ErrorKind::BrokenPipe, Fault::Reset),
            (io::ErrorKind::TimedOut, Fault::Timeout),
            (io::ErrorKind::UnexpectedEof, Fault::Incomplete),
        ] {
            assert_eq!(of_causes(&io(kind, "socket")), Some(fault), "{kind:?}");
        }
    }

    /// TLS failures reach reqwest as `InvalidData` I/O errors wrapping the TLS library's error
    /// (a certificate that does not verify, a handshake the peer botched): nothing in them
    /// says "try again", and trying again would fail the same way.
    #[test]
    fn certificate_and_other_permanent_failures_are_not_transient() {
        for (kind, text) in [
            (
                io::ErrorKind::InvalidData,
                "invalid peer certificate: UnknownIssuer",
            ),
            (io::ErrorKind::InvalidData, "received corrupt message"),
            (io::ErrorKind::PermissionDenied, "permission denied"),
            (io::ErrorKind::Other, "failed to lookup address information"),
        ] {
            assert_eq!(of_causes(&io(kind, text)), None, "{text}");
        }
    }

    /// A wrapper around a cause, as hyper and reqwest wrap theirs.
    #[derive(Debug)]
    struct Wrapped(io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("while connecting")
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn an_io_error_wrapping_a_decisive_one_is_judged_by_it() {
        // How reqwest's TLS connector reports a reset during the handshake.
        let wrapped = io::Error::other(io(io::ErrorKind::ConnectionReset, "reset by peer"));
        assert_eq!(wrapped.kind(), io::ErrorKind::Other);
        assert_eq!(of_causes(&wrapped), Some(Fault::Reset));
        let certificate = io::Error::new(
            io::ErrorKind::InvalidData,
            io(io::ErrorKind::Other, "invalid peer certificate"),
        );
        assert_eq!(of_causes(&certificate), None);
    }

    /// hyper's "channel closed": the connection had ended before the request was handed to
    /// it (a GOAWAY before any stream, an idle connection gone), so no byte of it was sent.
    #[tokio::test]
    async fn a_connection_closed_before_the_request_was_handed_to_it_sent_nothing() {
        let (near, _far) = tokio::io::duplex(64);
        let io = hyper_util::rt::TokioIo::new(near);
        let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, String>(io)
            .await
            .unwrap();
        drop(connection);
        let closed = sender.ready().await.unwrap_err();
        assert!(closed.is_closed(), "{closed:?}");
        assert_eq!(of_causes(&closed), Some(Fault::NotProcessed));
        assert!(Fault::NotProcessed.nothing_sent());
    }

    #[test]
    fn causes_are_found_deep_in_the_chain() {
        let refused = Wrapped(io(io::ErrorKind::ConnectionRefused, "refused"));
        assert_eq!(of_causes(&refused), Some(Fault::Reset));
        let certificate = Wrapped(io(io::ErrorKind::InvalidData, "invalid peer certificate"));
        assert_eq!(of_causes(&certificate), None);
    }
}
