//! Integration tests: the middleware against real servers on 127.0.0.1.

mod across_features;
mod attempt_headers;
mod auto_traits;
mod bodies;
mod budget;
mod classifier;
mod config;
mod core_rules;
pub(crate) mod dependencies;
#[cfg(feature = "tower")]
mod doors;
mod driver_model;
mod errors;
mod faults;
mod future_size;
#[cfg(feature = "grpc")]
mod grpc;
mod hedging;
mod idempotency;
mod latency;
mod layers;
mod layout;
mod methods;
mod properties;
mod rate_limit;
mod reference_server;
mod schedule;
mod server_says;
mod statuses;
mod support;
mod throttle;
mod time;
mod tracing_fields;
