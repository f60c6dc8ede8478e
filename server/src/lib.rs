//! The server half of an exactly-once effect: a tower layer that runs a handler once per
//! (scope, `Idempotency-Key`), on a durable outcome table in SQLite or PostgreSQL.
//!
//! One engine (the claim, the lease and its fence, the steps, the reconciler, the outbox, the
//! sweeper), a front per transport: HTTP ([`IdempotencyLayer`], for axum or any tower stack)
//! and gRPC (`grpc::GrpcIdempotencyLayer` from `Builder::build_grpc`, feature `grpc`, for
//! tonic servers: the key from `idempotency-key` metadata, the whole answer stored with its
//! trailers, the layer's own answers as gRPC statuses), and message consumers
//! ([`consumer::ConsumerLayer`] from [`Builder::build_consumer`]: a message's id the key, its
//! effects and outcome in one transaction, the acknowledgement after the commit, dead letters
//! with their reason; adapters for RabbitMQ, feature `rabbitmq`, and NATS JetStream, feature
//! `nats`). The outbox relays to HTTP, RabbitMQ and JetStream.
//!
//! A client that sends one key on every attempt (such as `reqwest-safe-retry`, the client half
//! in this workspace) and this layer together make an effect happen once, however many copies
//! of the request arrive, in whatever order, from however many servers.
//!
//! ```no_run
//! # #[cfg(all(feature = "sqlite", feature = "axum"))]
//! # async fn doc() -> Result<(), Box<dyn std::error::Error>> {
//! use axum::{Router, http::StatusCode, routing::post};
//! use safe_retry_server::{IdempotencyLayer, Local, SqliteStore};
//!
//! async fn create_order(mut tx: Local<SqliteStore>, body: String) -> (StatusCode, String) {
//!     // Written in the transaction that also stores this answer: both commit, or neither.
//!     let id: i64 = sqlx::query_scalar("INSERT INTO orders (body) VALUES (?) RETURNING id")
//!         .bind(body)
//!         .fetch_one(&mut **tx)
//!         .await
//!         .expect("the orders table exists");
//!     (StatusCode::CREATED, format!("{{\"order\":{id}}}"))
//! }
//!
//! let store = SqliteStore::open("sqlite://orders.db").await?;
//! let layer = IdempotencyLayer::builder(store)
//!     // Keys are unique per caller; `.shared_scope()` for a service with one caller.
//!     .scope(|parts| parts.headers.get("x-caller")?.to_str().ok().map(str::to_owned))
//!     .build()?;
//! let app: Router = Router::new().route("/orders", post(create_order)).layer(layer);
//! # let _ = app; Ok(()) }
//! ```
//!
//! # What each request gets
//!
//! For the guarded methods [POST, PATCH]:
//!
//! | The request | The answer |
//! |---|---|
//! | no key, where one is required | `400` `missing-key` |
//! | a malformed key (empty, too long, control characters, a broken quoted string) | `400` `malformed-key`, saying what is wrong |
//! | a body over the limit | `413` `body-too-large`, nothing stored |
//! | a body that does not arrive whole in time [10 s] | `408` `body-timeout`, nothing stored |
//! | a new key | the handler runs; its answer is stored with its local effects |
//! | the same key, another request (method, path, query or body) | `422` `key-reused`; the handler does not run |
//! | the same key while the first runs (or its row is held by a transaction that has not ended) | `409` `in-progress` with `Retry-After` and `retry-after-ms` |
//! | the same key once completed | the stored status, end-to-end headers and body byte for byte, plus `Idempotent-Replayed: true` (a stored `5xx` included) |
//! | the same key, the first's holder gone past its lease | the handler runs again (a takeover); the old holder can no longer complete |
//! | the store unreachable, or failing inside the handler | `503` `store-unavailable` with a retry hint; nothing stored, what ran rolled back, the lease ended |
//!
//! Errors are RFC 9457 `application/problem+json` bodies whose `type` is
//! `urn:safe-retry:problem:<name>` (see [`Problem`]). A handler that refuses a request before
//! doing anything marks its answer [`Rejected`]: nothing is stored, and a corrected request
//! with the same key runs.
//!
//! # The outcome table and its promises
//!
//! One row per (scope, key) — see [`store`] for the columns and the shipped migrations.
//!
//! - **The claim is atomic**: one `INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING`
//!   statement decides which request owns the execution; there is no read-then-write.
//! - **Leases and fencing**: the owner holds a lease [30 s]; a record left in progress past it
//!   may be taken over by the next request with the same key and fingerprint, which bumps the
//!   record's attempt. Every completion is conditional on the attempt that claimed it: a
//!   holder that was taken over writes nothing, its transaction (and its local effects) roll
//!   back, and it answers with the outcome the new holder recorded.
//! - **Local effects** written through [`Local`] commit in the same transaction as the stored
//!   answer.
//! - **Time** is the database's clock, so the servers of a fleet agree on leases.
//! - **Retention** [24 h] is separate from the lease; a [`Sweeper`] deletes expired records
//!   in bounded batches. A key renewed after its retention starts a new **generation** of its
//!   record: its starts are counted afresh, and its downstream keys are new.
//!
//! # What is stored, what is at rest, what burns a key
//!
//! | | |
//! |---|---|
//! | stored as the outcome | the handler's answer (status, end-to-end headers, body up to 1 MiB) with its local effects, a `5xx` it chose included |
//! | never stored | answers marked [`Rejected`] or [`Unfinished`]; the crate's answers for a failed store ([`LocalError::response`], [`StoreError::response`], [`StepError::response`]); statuses in [`Builder::not_stored`]; the layer's own failures |
//! | at rest while a record runs | the saved request: method, target, body, and the headers of [`Builder::saved_headers`] (never credentials); the steps' outputs |
//! | at rest after it completes | the answer only: the saved request and the steps' outputs are cleared (a failed record keeps its last recovery point and steps for an operator) |
//! | burns a key | [`Builder::max_attempts`] starts in one generation (first run, takeovers, resumptions; a caller that gives up mid-handler ends a start): the record ends failed and its key answers `500 gave-up` for [`Builder::failed_retention`]. Renewals never do. |
//!
//! # External effects: steps, the reconciler and the outbox
//!
//! Work that cannot join the answer's transaction (a charge at a payment provider, an email)
//! runs as named steps, each committed with the record as a recovery point
//! ([`Execution::step`]): a resumed request skips the steps done and resumes at the first not
//! done. A step's external call (`Pending::call`, feature `client`) goes out through this
//! workspace's client with an idempotency key derived from the record (its random
//! identity, drawn when it was created or renewed) and the step, so every attempt and resumption of the record sends the same key
//! and a renewed key sends a new one; a [`Reconciler`] finishes records stalled past their lease
//! when no client comes back; follow-on messages are staged in a step's transaction
//! ([`Pending::stage`]) and delivered at least once by a `Relay` (feature `client`) with keys derived from their
//! ids. Records started more than [`Builder::max_attempts`] times in one generation end failed.
//! What is left parked, stalled or failed an operator sees and acts on through
//! [`store::Operations`], served as JSON and a page by `operator::OperatorView` (feature
//! `operator`).
//!
//! ```no_run
//! # #[cfg(all(feature = "sqlite", feature = "client"))]
//! # async fn doc() {
//! use reqwest_middleware::ClientWithMiddleware;
//! use safe_retry_server::{Execution, SqliteStore, Step, StepError};
//!
//! /// Charges once per order, however often the handler is resumed.
//! async fn charge(
//!     execution: &Execution<SqliteStore>,
//!     payments: &ClientWithMiddleware,
//! ) -> Result<u16, StepError> {
//!     match execution.step("charge").await? {
//!         Step::Done(status) => Ok(status),
//!         Step::Todo(mut step) => {
//!             let answer = step.call(payments.post("http://127.0.0.1:9000/charges")).await?;
//!             step.commit(answer.status.as_u16()).await
//!         }
//!     }
//! }
//! # }
//! ```
//!
//! The crate's README walks through an order (an order row, a charge, a receipt through the
//! outbox), what a crash at each recovery point leaves behind, and who finishes it.
//!
//! # Where the edges are
//!
//! - **Scope.** The builder asks for one: keys by the authenticated caller
//!   ([`Builder::scope`]), or one scope every caller shares ([`Builder::shared_scope`]), where
//!   two callers that pick the same key share one record and a replay to the second never
//!   carries the first's `Set-Cookie`.
//! - **A handler that fails without an answer** (a service error, a failed answer body, a
//!   request dropped because its caller hung up) rolls its transaction back and ends its
//!   lease at once: the next request with the key takes the record over and runs the handler
//!   again, as attempt 2. A panic, or a killed process, leaves the record in progress until
//!   the lease runs out. Effects outside the database (a call to another service) are not
//!   rolled back: make them steps, whose calls carry an idempotency key of their own.
//! - **Answers larger than the limit** [1 MiB] reach the first caller whole; a replay gets the
//!   stored status with an `answer-not-stored` problem body. An HTTP answer's trailers reach
//!   its first caller and are not stored (the gRPC front stores a call's trailers).
//! - **Requests the layer does not guard** (other methods; no key where none is required)
//!   pass through with nothing recorded.
//! - **Extractor rejections** (axum's `Json` refusing a body, say) are answers like any
//!   other and are stored, unless marked [`Rejected`] or their status is in
//!   [`Builder::not_stored`].
//!
//! # Operations
//!
//! Every event is listed, with its default level and fields, on [`Event`]; change one with
//! [`Builder::event_level`]. The counters are on [`Counters`], and through the `metrics`
//! facade with the `metrics` feature. A [`Reconciler`], a `Relay` and a [`Sweeper`] each
//! `run(every)` on tokio.
//!
//! # Features
//!
//! - `sqlite` (default): `SqliteStore`, SQLite bundled (nothing to install).
//! - `postgres`: `PostgresStore`, for a fleet sharing one database.
//! - `mysql`: `MySqlStore`, for a fleet sharing one MySQL 8 or MariaDB 10.11+ database.
//! - `axum`: [`Local`] and [`Execution`] as extractors, [`Rejected`] as a response part,
//!   [`StepError`] as a response.
//! - `client`: `Pending::call` and the `Relay`, through `reqwest-safe-retry` (it brings
//!   reqwest in).
//! - `metrics`: the counters through the `metrics` facade.
//! - `grpc`: the gRPC front for tonic servers (`Builder::build_grpc`), and tonic statuses for
//!   the crate's errors.
//! - `test-util`: the `testing` module, crash points for your own tests.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod body;
mod config;
mod engine;
mod events;
mod execution;
mod fingerprint;
mod front;
mod headers;
mod key;
mod layer;
mod markers;
#[cfg(feature = "operator")]
#[cfg_attr(docsrs, doc(cfg(feature = "operator")))]
pub mod operator;
#[cfg(feature = "client")]
mod outgoing;
mod problem;
mod reconciler;
#[cfg(any(feature = "client", feature = "rabbitmq", feature = "nats"))]
mod relay;
mod step;
pub mod store;
mod sweeper;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;
mod transport;
mod worker;

pub use body::{BoxError, ReplyBody, SavedBody};
pub use config::{CounterSnapshot, Counters};
pub use engine::IdempotentFuture;
pub use events::Event;
pub use execution::{Execution, Local, LocalError, Rejected};
pub use fingerprint::Fingerprint;
pub use front::http::Idempotent;

/// The gRPC front: a layer for tonic servers (feature `grpc`).
///
/// Build it with [`Builder::grpc_method`] and [`Builder::build_grpc`]; see the crate's README
/// for what is stored and the table of the layer's own statuses.
#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
pub mod grpc {
    pub use crate::front::grpc::{GrpcIdempotencyLayer, GrpcIdempotent, PROBLEM, code_of};
}
/// The consumer front: messages from a queue or a stream, each processed once per (scope,
/// message id), acknowledged only after its outcome commits.
///
/// Build it with [`Builder::build_consumer`]; run a broker's adapter over the [`Consumer`]
/// (`RabbitMq`, feature `rabbitmq`; `JetStream`, feature `nats`), or write one for another
/// broker: see the crate's README.
///
/// [`Consumer`]: consumer::Consumer
pub mod consumer {
    #[cfg(feature = "nats")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    pub use crate::front::consumer::nats::JetStream;
    #[cfg(feature = "rabbitmq")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
    pub use crate::front::consumer::rabbitmq::RabbitMq;
    pub use crate::front::consumer::{
        Consumer, ConsumerLayer, DeadLetter, Delivery, MESSAGE_ID, Verdict,
    };
}
pub use headers::IDEMPOTENT_REPLAYED;
pub use key::{IDEMPOTENCY_KEY, KeyForm, KeySource};
pub use layer::{Builder, ConfigError, IdempotencyLayer};
pub use problem::Problem;
pub use reconciler::{ReconcileReport, Reconciler};
#[cfg(any(feature = "client", feature = "rabbitmq", feature = "nats"))]
pub use relay::{Relay, RelayReport};
#[cfg(feature = "client")]
pub use step::Downstream;
pub use step::{Message, Pending, Step, StepError, Unfinished};
#[cfg(feature = "postgres")]
pub use store::PostgresStore;
#[cfg(feature = "mysql")]
pub use store::{MySqlBuilder, MySqlStore};
#[cfg(feature = "sqlite")]
pub use store::{SqliteBuilder, SqliteStore};
pub use store::{Store, StoreError};
pub use sweeper::{SweepReport, Sweeper};

/// The README's examples, compiled as doctests.
#[cfg(all(doctest, feature = "sqlite", feature = "axum", feature = "client"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
