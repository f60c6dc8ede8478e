//! The driver: the only code that sends, times out, sleeps and awaits; it decides nothing. The
//! middleware and what its requests share (`middleware`), one logical request's phases
//! (`phases`), what it keeps of itself (`request`), the attempt in
//! flight (`attempt`), bodies read inside
//! an attempt or kept through a wait (`body`), the claim that lets one layer retry (`claim`, and
//! `uri`: a request's fingerprint from its URI),
//! and its tracing (`trace`). It builds the record a request ends with (`crate::record`).

pub(crate) mod attempt;
#[cfg(any(feature = "tower", feature = "grpc"))]
pub(crate) mod beneath_service;
pub(crate) mod body;
pub(crate) mod claim;
pub(crate) mod middleware;
pub(crate) mod phases;
pub(crate) mod request;
#[cfg(any(feature = "tower", feature = "grpc"))]
pub(crate) mod retry_body;
#[cfg(test)]
pub(crate) mod scripted;
#[cfg(any(feature = "tower", feature = "grpc"))]
pub(crate) mod send_body;
pub(crate) mod trace;
#[cfg(any(feature = "tower", feature = "grpc"))]
pub(crate) mod uri;
