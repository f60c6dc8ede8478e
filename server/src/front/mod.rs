//! The fronts: one per transport, each turning its requests into the engine's units of work
//! and the engine's outcomes back into its answers. No front names another.

#[cfg(feature = "grpc")]
pub(crate) mod grpc;
pub(crate) mod http;
