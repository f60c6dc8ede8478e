//! The third front door: [`GrpcRetryLayer`], retries for gRPC clients (tonic) as gRFC A6 says,
//! on the same engine and driver as the other two doors.
//!
//! The layer wraps a gRPC transport (a tonic `Channel`): each call tonic's generated client
//! sends comes to the driver as a `Call` (tonic's request, its body kept whole in memory when
//! it is at hand and within the buffer limits), under the dependency of its method's config;
//! each copy goes to the transport as tonic's request again, and each answer comes back as
//! the transport's, read into the engine's neutral head. This door holds no rule: which status
//! is retried, what a committed call is, the pushback, the backoff, the throttling and the
//! headers an attempt carries are the engine's (`engine::grpc`), beside the HTTP ones.
//!
//! Laid out as the tower door is: the layer (`layer`), the service (`service`), the call as the
//! driver keeps it (`call`), and this door's side of the driver (`inner`: where each copy goes,
//! how its errors are read, and the answer's body).

mod call;
mod inner;
mod layer;
#[cfg(feature = "metrics")]
mod metrics;
mod service;

pub use inner::GrpcBody;
pub use layer::GrpcRetryLayer;
pub use service::GrpcRetryService;
