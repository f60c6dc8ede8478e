//! The fronts: one per transport (HTTP, gRPC, message consumers), each turning its requests into the engine's units of work
//! and the engine's outcomes back into its answers. No front names another.

pub(crate) mod consumer;
#[cfg(feature = "grpc")]
pub(crate) mod grpc;
pub(crate) mod http;
