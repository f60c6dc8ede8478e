//! The server half's tests: every rule on every store, through real HTTP and a real database.
//!
//! SQLite needs nothing; the PostgreSQL tests (feature `postgres`, on under
//! `cargo test --all-features`) need a server at `SAFE_RETRY_POSTGRES_URL`
//! [postgres://postgres@127.0.0.1:5432/test] and fail saying so when there is none.

mod both_halves;
#[allow(dead_code)]
#[path = "../../examples/support/charges_app.rs"]
mod charges_app;
mod config;
mod direct;
#[path = "../../examples/support/lossy_link.rs"]
mod lossy_link;
mod model;
mod rules;
mod support;
