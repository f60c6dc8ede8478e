//! Retries for [`reqwest`] that are safe to repeat.
#![deny(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![forbid(unsafe_code)]

mod backoff;
mod body;
mod classify;
mod clock;
mod error;
mod middleware;
mod policy;
mod rng;

#[cfg(feature = "test-util")]
pub use clock::FakeClock;
pub use clock::{Clock, Sleep, TokioClock};
pub use error::{RetryError, RetryRecord, StopReason};
pub use middleware::RetryMiddleware;
pub use policy::{InvalidPolicy, RetryPolicy, RetryPolicyBuilder};
pub use rng::{Rng, SeededRng, ThreadRng};
