//! The engine: every rule of the crate, sans-IO. Handed values (the time now, the wall time
//! when a date must be read, an attempt's outcome as a neutral head and fault, the headers it
//! needs), it answers the next action; it never reads a clock, never awaits, and never names a
//! client library. The driver (`crate::driver`) runs what it answers; the doors
//! (`crate::door`) bring each client's requests to the driver.

pub(crate) mod advice;
pub(crate) mod attempt_headers;
pub(crate) mod backoff;
pub(crate) mod budget;
pub(crate) mod classifier;
pub(crate) mod classify;
pub(crate) mod course;
pub(crate) mod decide;
pub(crate) mod dependency;
#[cfg(feature = "grpc")]
pub(crate) mod grpc;
pub(crate) mod idempotency;
pub(crate) mod latency;
pub(crate) mod observed;
pub(crate) mod policy;
pub(crate) mod rate_limit;
pub(crate) mod retry_after;
pub(crate) mod rules;
pub(crate) mod schedule;
pub(crate) mod seen;
pub(crate) mod throttle;
