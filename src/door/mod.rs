//! The front doors: one per kind of client, each on its own types. `reqwest` puts the driver in
//! a `reqwest-middleware` chain; `tower` (feature `tower`) wraps a tower service of
//! `http::Request`s; `grpc` (feature `grpc`) wraps a gRPC transport (a tonic `Channel`).

#[cfg(feature = "grpc")]
pub(crate) mod grpc;
#[cfg(feature = "reqwest")]
pub(crate) mod reqwest;
#[cfg(feature = "tower")]
pub(crate) mod tower;
