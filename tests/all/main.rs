//! Integration tests: the middleware against real servers on 127.0.0.1.

mod bodies;
// Needs the simulator: run with --all-features (as CI does).
#[cfg(feature = "sim")]
mod budget;
mod dependencies;
mod faults;
mod idempotency;
mod methods;
mod properties;
mod reference_server;
mod schedule;
mod statuses;
mod support;
mod time;
mod tracing_fields;
