//! The second front door: [`RetryMiddleware`] as a tower [`Layer`], for HTTP clients built as a
//! [`Service`] of `http::Request`s (hyper-util's client, a `tower::ServiceBuilder` stack).
//!
//! The layer is the same middleware: the same dependencies, clock, random source, observer and
//! log levels, the same core and the same driver, which is generic over the door. This door
//! hands the driver its caller's `http::Request` as it is (its body made a [`SendBody`], which
//! is copied for another attempt by reference count when it is whole in memory); each copy goes
//! down to the inner service as such a request, and each answer comes back as the inner service's
//! `http::Response`, its body passed on as it is in a [`RetryBody`], through the same judging,
//! waiting, record and tracing as on the reqwest side. No `reqwest::Request`, `Url` or
//! `reqwest::Response` is made. What differs is where a copy goes ([`Inner`]), how a request is
//! copied and named (its `Outgoing` impl), how an answer's body is read (its `Reply` impl),
//! and how the inner service's errors are read (`service_fault`: by their causes, and
//! hyper-util's connect failures as nothing sent); the inner service's own error is what a
//! classifier and a give-up's sources see.
//!
//! Bodies: a body whose frames are all at hand when the request is made (`Full<Bytes>`, a
//! `String`, an empty one, a stream of chunks all at hand) is kept as `Bytes` for a retry or a
//! hedge; one that streams is sent once, as on the reqwest side, and the record says why
//! nothing was retried.
//!
//! One layer retries: each copy carries a mark in its extensions, and an instance of the layer
//! further in that sees it sends the request on untouched.
//!
//! Laid out as tower-http lays out a middleware: the layer (`layer`), the service (`service`),
//! the futures it answers with (`future`), the bodies (`body` for an answer, `send_body` for a
//! request), and this door's side of the driver (`inner`: where each copy goes and how its
//! outcome is read; `error`: the inner service's errors, read by their causes).

mod error;
mod future;
mod inner;
mod layer;
mod service;

#[cfg(test)]
mod tests;

pub use service::RetryService;
