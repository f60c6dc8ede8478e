//! The outcome table behind the layer: a small trait, and one implementation per database.
//!
//! Every store keeps one row per (scope, key) with the request's fingerprint, its status
//! (`in_progress` or `completed`), the stored answer, the lease (`locked_until`), the fencing
//! counter (`attempt`), `created_at` and `expires_at`. The schema ships with the crate as
//! migrations (`migrations/sqlite`, `migrations/postgres`, `migrations/mysql`); each store's
//! `migrate` applies them,
//! recording what it applied in its own table, `safe_retry_schema`, so that it never meets the
//! migrations of the application that shares the database.
//!
//! The promises every store keeps, and that the test suite proves on each of them:
//!
//! - [`Outcomes::try_claim`] is one atomic statement: of any number of concurrent claims of one key,
//!   exactly one owns the execution; a claim takes over a record whose lease has run out (with the
//!   same fingerprint) or whose retention has run out, and bumps its attempt.
//! - [`Outcomes::complete`] and [`Outcomes::release`] are fenced: they change the record only while it
//!   is still held by the attempt that claimed it, in the transaction the handler wrote in, and a
//!   refused write rolls that whole transaction back.
//! - Time is the database's clock, read in the statements themselves.
//!
//! # A fourth store
//!
//! A backend implements [`Outcomes`], [`RecoveryPoints`] and [`Outbox`] (and [`Operations`] for
//! the operator's view), and joins the suite the three stores run (`server/tests/all`):
//!
//! 1. `support.rs`: implement `Backend` for it: a fresh database per test (a file, a schema, a
//!    database), the hooks that move time (`end_lease`, `end_retention`), stall it (`stall`,
//!    `hold_writes`, `lock_row`), break it (`break_outcomes`) and read it back (`outcomes`,
//!    `point_of`), and a `fresh_url` whose failure to connect says how to get a server.
//! 2. `examples/support/charges_app.rs`: implement `ChargesDb` (the example's effects table),
//!    and let `examples/charges.rs` open its URL: the process tests start the example.
//! 3. `main.rs`: add a module to `on_every_store!` (every rule, the steps, the gRPC front, the
//!    operator's view, the first month's defects run in it), and to `consumer.rs`'s macro; then
//!    one line each where a test names its stores: `model.rs`, `step_model.rs`, `config.rs`
//!    (migrations, extractors), `crash.rs` (a real kill at every recovery point), `pause.rs`,
//!    `both_halves.rs`, `fleet.rs` (for a store a fleet can share), `rules.rs` (the server
//!    cutting its connections), `auto_traits.rs`.
//! 4. `.ci/run`: ask the server to answer before anything is built.
//!
//! A store that keeps shorter keys than a layer takes says so in [`Outcomes::MAX_KEY_LEN`]; a
//! store whose keys compare by a collation fails `keys_and_scopes_are_compared_byte_for_byte`.

#[cfg(feature = "mysql")]
mod mysql;
mod operations;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "mysql")]
pub use mysql::{MySqlBuilder, MySqlStore};
pub use operations::{Operations, RecordView, Standing, Tally};
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteBuilder, SqliteStore};

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

/// A whole store: the outcome table, its recovery points and its outbox. What the layers take.
///
/// Implemented for every type that provides the three parts; a backend implements
/// [`Outcomes`], [`RecoveryPoints`] and [`Outbox`], never this. A worker or a front that
/// needs less takes less: a [`Sweeper`](crate::Sweeper) takes any [`Outcomes`], a `Relay`
/// any [`Outbox`].
///
/// The layers call these methods; an application calls only its store's constructor,
/// `migrate` and `sweep`. A new store implements the three parts and runs the crate's test
/// suite ([the module's docs](self#a-fourth-store) say how it joins).
pub trait Store: Outcomes + RecoveryPoints + Outbox {}

impl<T: Outcomes + RecoveryPoints + Outbox> Store for T {}

/// The outcome table: one row per (scope, key), claimed atomically, held under a fenced
/// lease, completed with the handler's local effects, kept for its retention.
pub trait Outcomes: Clone + Send + Sync + 'static {
    /// The transaction a handler writes its local effects in. It commits with the record's
    /// completion, or rolls back with it.
    type Tx: Send + 'static;

    /// The longest key the store keeps, in bytes \[4096, the most a layer takes\]: a layer
    /// whose `max_key_len` is longer is refused when it is built.
    const MAX_KEY_LEN: usize = 4096;

    /// Claims the key in one atomic statement.
    ///
    /// Returns the holder's fence when this call owns the execution: the key was new, its
    /// retention had ended (a renewal: a new generation), or it was `in_progress` under the
    /// same fingerprint past its lease (a takeover). Returns `None` when another holder or a
    /// completed outcome has it, or when another transaction holds the record's row locked: a
    /// claim never waits on a row lock without a bound.
    fn try_claim(
        &self,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<Option<Claimed>, StoreError>> + Send;

    /// Reads the record of (scope, key), if there is one.
    fn read(
        &self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Opens the transaction a handler writes its local effects in.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Stores the answer and marks the record completed, in `tx` when the handler opened one,
    /// then commits. The saved request and the steps' outputs are cleared with it. When the record is no longer held by `fence` (another attempt took it
    /// over) nothing is written, `tx` is rolled back and the result is
    /// [`Completion::Fenced`].
    fn complete(
        &self,
        tx: Option<Self::Tx>,
        fence: Fence,
        answer: &StoredAnswer,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;

    /// Deletes the record while `fence` still holds it (a request the handler rejected before
    /// doing anything), and rolls `tx` back. Returns whether the record was deleted.
    fn release(
        &self,
        tx: Option<Self::Tx>,
        fence: Fence,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Ends the lease of the record now while `fence` still holds it (a handler that failed
    /// without an answer, or whose request was dropped): the next request with the key takes
    /// it over at once instead of waiting out the lease. Returns whether the lease was ended.
    fn abandon(&self, fence: Fence) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes at most `batch` records whose retention has ended (and whose lease, if they are
    /// still in progress, has ended too), and at most `batch` outbox messages whose retention
    /// has ended (sent or failed ones), in short statements. Returns how many rows it deleted:
    /// call it again while that equals or passes `batch`.
    fn sweep(&self, batch: u32) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Ends the record in the `failed` state with `answer` (what every later request with the
    /// key is sent), kept for `retention` from now, while `fence` still holds it. The saved
    /// request is cleared; the last recovery point and the steps' outputs stay for an operator.
    fn fail(
        &self,
        fence: Fence,
        answer: &StoredAnswer,
        retention: Duration,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;
}

/// Recovery points: the committed steps of a record in progress, the request it saved for a
/// resumption, and the search for records a resumption can finish.
pub trait RecoveryPoints: Outcomes {
    /// Reads what earlier holders of the record committed: the steps' outputs and the saved
    /// request. A resumption reads it once, after its claim.
    fn progress(&self, fence: Fence) -> impl Future<Output = Result<Progress, StoreError>> + Send;

    /// Commits a recovery point while `fence` still holds the record, in `tx` when the step
    /// opened one (its local effects and staged messages commit with it), and renews the lease.
    /// When the record is no longer held by `fence` nothing is written, `tx` is rolled back and
    /// the result is [`Completion::Fenced`].
    fn commit_step(
        &self,
        tx: Option<Self::Tx>,
        fence: Fence,
        write: &StepWrite<'_>,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;

    /// Up to `batch` records a resumption can finish: in progress, past their lease, within
    /// their retention, with a saved request (they reached a recovery point). Oldest lease
    /// first. Reading them claims nothing: each is then claimed like any request.
    fn stalled(&self, batch: u32) -> impl Future<Output = Result<Vec<Stalled>, StoreError>> + Send;
}

/// The transactional outbox: messages staged in a handler's transaction, taken and settled by
/// a relay.
pub trait Outbox: Outcomes {
    /// Stages an outbox message in `tx`: it exists once `tx` commits, and never before. A
    /// message whose id is already staged is left as it is.
    fn stage(
        &self,
        tx: &mut Self::Tx,
        message: &StagedMessage<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Takes up to `batch` pending messages that are due, for `lease`: each is due again after
    /// it unless it is settled first, and its delivery count goes up by one (the fence of
    /// [`settle`](Outbox::settle)). Two relays never take one message at once.
    fn take_messages(
        &self,
        batch: u32,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, StoreError>> + Send;

    /// Settles a message taken under `delivery`: sent, to be tried again, or failed. Returns
    /// `false` (and writes nothing) when another relay has taken it since.
    fn settle(
        &self,
        id: &str,
        delivery: i64,
        settle: &Settle,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// What earlier holders of a record committed, read by a resumption.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// The committed steps' outputs: a JSON object by step name.
    pub steps: Option<String>,
    /// The request as saved with the first recovery point, in the layer's own encoding.
    pub request: Option<Bytes>,
}

/// A recovery point to commit.
#[derive(Debug, Clone, Copy)]
pub struct StepWrite<'a> {
    /// The recovery point's name, kept in the record's `step` column (`charge:started`,
    /// `charge:done`).
    pub point: &'a str,
    /// Every committed step's output (a JSON object by step name), when this point adds one;
    /// `None` leaves them as they are.
    pub steps: Option<&'a str>,
    /// The request, when the record has not saved it yet; `None` leaves it as it is.
    pub request: Option<&'a [u8]>,
    /// The lease from now: a recovery point renews it.
    pub lease: Duration,
}

/// A record a resumption can finish, as [`RecoveryPoints::stalled`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stalled {
    /// The caller's scope.
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The fingerprint of the request that created it: a resumption claims with it.
    pub fingerprint: [u8; 32],
}

/// An outbox message as a handler stages it.
#[derive(Debug, Clone, Copy)]
pub struct StagedMessage<'a> {
    /// The message's natural id: the relay derives the delivery's idempotency key from it.
    pub id: &'a str,
    /// The HTTP method.
    pub method: &'a str,
    /// The URL.
    pub url: &'a str,
    /// The headers, in order.
    pub headers: &'a [(HeaderName, HeaderValue)],
    /// The body.
    pub body: &'a [u8],
}

/// An outbox message a relay took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The message's natural id.
    pub id: String,
    /// The HTTP method.
    pub method: String,
    /// The URL.
    pub url: String,
    /// The headers.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body.
    pub body: Bytes,
    /// How many times a relay has taken it, this time included: the fence of its settlement.
    pub delivery: i64,
}

/// How a delivery ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settle {
    /// The receiver answered 2xx: the message is sent, kept for `keep`.
    Sent {
        /// The receiver's status.
        status: u16,
        /// How long the row is kept.
        keep: Duration,
    },
    /// Not delivered this time: due again after `after`.
    Retry {
        /// The wait before the next delivery.
        after: Duration,
        /// What went wrong, kept in the row.
        error: String,
    },
    /// Not to be delivered: the receiver refused it for good, or the relay gave up. Kept for
    /// `keep`.
    Failed {
        /// The receiver's status, when it answered.
        status: Option<u16>,
        /// What went wrong.
        error: String,
        /// How long the row is kept.
        keep: Duration,
    },
}

/// What a claim asks the store for.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The caller's scope.
    pub scope: &'a str,
    /// The idempotency key.
    pub key: &'a str,
    /// The request's fingerprint.
    pub fingerprint: &'a [u8; 32],
    /// How long the holder may run before another request may take the record over.
    pub lease: Duration,
    /// How long the record is kept after it is created.
    pub retention: Duration,
}

/// Which holder of a record a write comes from: the record's row id and the attempt that
/// claimed it. A takeover bumps the attempt, and a record deleted and claimed again gets a new
/// id, so a stale holder's fence never matches again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    /// The record's row id.
    pub id: i64,
    /// The attempt counter this holder claimed.
    pub attempt: i64,
}

/// The result of a successful claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The fence every later write of this holder carries.
    pub fence: Fence,
    /// The attempt at which the record's current generation began: its first claim, or the
    /// claim that renewed it after its retention. The generation's starts so far are
    /// `fence.attempt - generation + 1`.
    pub generation: i64,
    /// The record's identity, drawn at random by the claim that created or renewed it: the
    /// keys its steps and messages send downstream derive from it, so they are the same for
    /// every attempt, takeover and resumption of one generation, and never meet another
    /// generation's, another row's or another database's.
    pub identity: String,
    /// Whether this claim took over a record another holder left in progress past its lease.
    pub taken_over: bool,
}

/// A record as read from the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The fingerprint of the request that created the record.
    pub fingerprint: [u8; 32],
    /// The identity of the record's generation ([`Claimed::identity`]): a holder fenced out of
    /// its record tells its own generation from a renewal by it.
    pub identity: String,
    /// Where the record stands.
    pub state: RecordState,
}

/// Where a record stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// A holder is executing it; its lease ends after `lease_left` (zero: it has ended).
    InProgress {
        /// The time left on the holder's lease, by the database's clock.
        lease_left: Duration,
    },
    /// Completed, with the stored answer.
    Completed(StoredAnswer),
}

/// The answer stored for a completed key: what a replay sends back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAnswer {
    /// The status code.
    pub status: StatusCode,
    /// The end-to-end headers, in order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, byte for byte; `None` when it was larger than the layer stores.
    pub body: Option<Bytes>,
}

/// How a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// The answer and the handler's local effects committed together.
    Completed,
    /// Another attempt holds the record: nothing was written and the handler's transaction was
    /// rolled back.
    Fenced,
}

/// A store that could not be reached or refused a statement.
#[derive(Debug, thiserror::Error)]
#[error("the outcome store failed: {0}")]
pub struct StoreError(#[source] Box<dyn std::error::Error + Send + Sync>);

impl StoreError {
    /// Wraps a database error.
    pub fn new(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
        StoreError(error.into())
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> StoreError {
        StoreError(Box::new(error))
    }
}

/// Ends a fenced write's transaction: commits it when the write changed the record
/// (`Completion::Completed`), rolls it back (the handler's effects with it) when the fence
/// matched no row (`Completion::Fenced`).
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) async fn end_fenced<DB: sqlx::Database>(
    tx: sqlx::Transaction<'static, DB>,
    rows_changed: u64,
) -> Result<Completion, StoreError> {
    if rows_changed == 0 {
        tx.rollback().await?;
        return Ok(Completion::Fenced);
    }
    tx.commit().await?;
    Ok(Completion::Completed)
}

/// Encodes headers as the stores keep them: per header, the name's length (2 bytes), the
/// value's length (4 bytes, big-endian), the name, the value.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn encode_headers(headers: &[(HeaderName, HeaderValue)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        headers
            .iter()
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum(),
    );
    for (name, value) in headers {
        let name = name.as_str().as_bytes();
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// Decodes what [`encode_headers`] wrote. A row that does not decode (edited by hand) is an
/// error, never a panic.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn decode_headers(
    mut bytes: &[u8],
) -> Result<Vec<(HeaderName, HeaderValue)>, StoreError> {
    let bad = || StoreError::new("a stored answer's headers do not decode");
    let mut headers = Vec::new();
    while !bytes.is_empty() {
        let (lengths, rest) = bytes.split_at_checked(6).ok_or_else(bad)?;
        let name_len = u16::from_be_bytes([lengths[0], lengths[1]]) as usize;
        let value_len =
            u32::from_be_bytes([lengths[2], lengths[3], lengths[4], lengths[5]]) as usize;
        let (name, rest) = rest.split_at_checked(name_len).ok_or_else(bad)?;
        let (value, rest) = rest.split_at_checked(value_len).ok_or_else(bad)?;
        let name = HeaderName::from_bytes(name).map_err(|_| bad())?;
        let value = HeaderValue::from_bytes(value).map_err(|_| bad())?;
        headers.push((name, value));
        bytes = rest;
    }
    Ok(headers)
}

/// Builds a stored answer from a row's columns.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn answer_of(
    status: Option<i64>,
    headers: Option<Vec<u8>>,
    body: Option<Vec<u8>>,
) -> Result<StoredAnswer, StoreError> {
    let status = status
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| StoreError::new("a completed record has no valid status"))?;
    Ok(StoredAnswer {
        status,
        headers: decode_headers(headers.as_deref().unwrap_or_default())?,
        body: body.map(Bytes::from),
    })
}

/// A record from a row's columns, as every store reads them.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn record_of(
    fingerprint: &[u8],
    status: &str,
    response_status: Option<i64>,
    response_headers: Option<Vec<u8>>,
    response_body: Option<Vec<u8>>,
    lease_left_ms: i64,
    identity: String,
) -> Result<Record, StoreError> {
    let state = if status == "completed" || status == "failed" {
        RecordState::Completed(answer_of(response_status, response_headers, response_body)?)
    } else {
        RecordState::InProgress {
            lease_left: Duration::from_millis(lease_left_ms.max(0) as u64),
        }
    };
    Ok(Record {
        fingerprint: fingerprint_of(fingerprint)?,
        identity,
        state,
    })
}

/// A fingerprint column as 32 bytes.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn fingerprint_of(column: &[u8]) -> Result<[u8; 32], StoreError> {
    column
        .try_into()
        .map_err(|_| StoreError::new("a record's fingerprint is not 32 bytes"))
}

/// Encodes a request as a record saves it for a resumption: the method's length (2 bytes),
/// the target's length (4 bytes), the headers' length (4 bytes, big-endian), then the method,
/// the target (path and query), the headers ([`encode_headers`]'s form) and the body.
pub(crate) fn encode_request(
    method: &http::Method,
    target: &str,
    headers: &[(HeaderName, HeaderValue)],
    body: &[u8],
) -> Vec<u8> {
    let headers = encode_headers(headers);
    let method = method.as_str().as_bytes();
    let mut out = Vec::with_capacity(10 + method.len() + target.len() + headers.len() + body.len());
    out.extend_from_slice(&(method.len() as u16).to_be_bytes());
    out.extend_from_slice(&(target.len() as u32).to_be_bytes());
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    out.extend_from_slice(method);
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(&headers);
    out.extend_from_slice(body);
    out
}

/// A request as a record saved it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SavedRequest {
    pub(crate) method: http::Method,
    pub(crate) target: String,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

/// Decodes what [`encode_request`] wrote; a row that does not decode is an error, never a
/// panic.
pub(crate) fn decode_request(bytes: &Bytes) -> Result<SavedRequest, StoreError> {
    let bad = || StoreError::new("a saved request does not decode");
    let (lengths, rest) = bytes.split_at_checked(10).ok_or_else(bad)?;
    let method_len = u16::from_be_bytes([lengths[0], lengths[1]]) as usize;
    let target_len = u32::from_be_bytes([lengths[2], lengths[3], lengths[4], lengths[5]]) as usize;
    let headers_len = u32::from_be_bytes([lengths[6], lengths[7], lengths[8], lengths[9]]) as usize;
    let (method, rest) = rest.split_at_checked(method_len).ok_or_else(bad)?;
    let (target, rest) = rest.split_at_checked(target_len).ok_or_else(bad)?;
    let (headers, _) = rest.split_at_checked(headers_len).ok_or_else(bad)?;
    let body_at = 10 + method_len + target_len + headers_len;
    Ok(SavedRequest {
        method: http::Method::from_bytes(method).map_err(|_| bad())?,
        target: std::str::from_utf8(target).map_err(|_| bad())?.to_owned(),
        headers: decode_headers(headers)?,
        body: bytes.slice(body_at..),
    })
}

/// A stalled record from a row's columns (`scope`, `key`, `fingerprint`), as every store
/// reads them.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn stalled_of<R>(row: &R) -> Result<Stalled, StoreError>
where
    R: sqlx::Row,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
{
    Ok(Stalled {
        scope: row.try_get("scope")?,
        key: row.try_get("key")?,
        fingerprint: fingerprint_of(&row.try_get::<Vec<u8>, _>("fingerprint")?)?,
    })
}

/// An outbox message from a row's columns, as every store reads them.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn message_of<R>(row: &R) -> Result<OutboxMessage, StoreError>
where
    R: sqlx::Row,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
{
    Ok(OutboxMessage {
        id: row.try_get("id")?,
        method: row.try_get("method")?,
        url: row.try_get("url")?,
        headers: decode_headers(&row.try_get::<Vec<u8>, _>("headers")?)?,
        body: Bytes::from(row.try_get::<Vec<u8>, _>("body")?),
        delivery: row.try_get("deliveries")?,
    })
}

/// A settlement as the outbox's columns take it: status, the receiver's status, the error,
/// how long the row is kept (ms, when it ends) and the wait before it is due again (ms, when
/// it is tried again).
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn settle_columns(
    settle: &Settle,
) -> (
    &'static str,
    Option<i32>,
    Option<&str>,
    Option<i64>,
    Option<i64>,
) {
    match settle {
        Settle::Sent { status, keep } => (
            "sent",
            Some(i32::from(*status)),
            None,
            Some(millis(*keep)),
            None,
        ),
        Settle::Retry { after, error } => {
            ("pending", None, Some(error), None, Some(millis(*after)))
        }
        Settle::Failed {
            status,
            error,
            keep,
        } => (
            "failed",
            status.map(i32::from),
            Some(error),
            Some(millis(*keep)),
            None,
        ),
    }
}

/// A duration in whole milliseconds, for a statement's parameter (saturating).
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_in_order_with_repeats_and_opaque_bytes() {
        let headers = vec![
            (
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            ),
            (
                HeaderName::from_static("set-cookie"),
                HeaderValue::from_static("a=1"),
            ),
            (
                HeaderName::from_static("set-cookie"),
                HeaderValue::from_static("b=2"),
            ),
            (
                HeaderName::from_static("x-empty"),
                HeaderValue::from_static(""),
            ),
            (
                HeaderName::from_static("x-opaque"),
                HeaderValue::from_bytes(&[0xff, b'a', 0x80]).unwrap(),
            ),
        ];
        assert_eq!(decode_headers(&encode_headers(&headers)).unwrap(), headers);
        assert_eq!(decode_headers(&[]).unwrap(), vec![]);
    }

    #[test]
    fn a_truncated_or_garbled_header_column_is_an_error_not_a_panic() {
        let encoded = encode_headers(&[(
            HeaderName::from_static("x-a"),
            HeaderValue::from_static("value"),
        )]);
        for cut in 1..encoded.len() {
            assert!(decode_headers(&encoded[..cut]).is_err(), "cut at {cut}");
        }
        // A name that is not a header name.
        let mut bad = encoded.clone();
        bad[6] = b' ';
        assert!(decode_headers(&bad).is_err());
        // A value with a control character.
        let mut bad = encoded;
        let last = bad.len() - 1;
        bad[last] = b'\n';
        assert!(decode_headers(&bad).is_err());
    }

    #[test]
    fn a_saved_request_round_trips_and_a_cut_or_garbled_one_is_an_error() {
        let headers = vec![(
            HeaderName::from_static("content-type"),
            HeaderValue::from_static("application/json"),
        )];
        let encoded = Bytes::from(encode_request(
            &http::Method::PATCH,
            "/orders/7?x=1",
            &headers,
            b"{\"a\":1}",
        ));
        let saved = decode_request(&encoded).unwrap();
        assert_eq!(saved.method, http::Method::PATCH);
        assert_eq!(saved.target, "/orders/7?x=1");
        assert_eq!(saved.headers, headers);
        assert_eq!(&saved.body[..], b"{\"a\":1}");
        let head = encoded.len() - 7;
        for cut in 0..head {
            assert!(
                decode_request(&encoded.slice(..cut)).is_err(),
                "cut at {cut}"
            );
        }
        let empty = Bytes::from(encode_request(&http::Method::POST, "/", &[], b""));
        assert_eq!(&decode_request(&empty).unwrap().body[..], b"");
        let mut bad = encoded.to_vec();
        bad[10] = b' '; // the method
        assert!(decode_request(&Bytes::from(bad)).is_err());
        let mut bad = encoded.to_vec();
        bad[15] = 0xff; // the target is not UTF-8
        assert!(decode_request(&Bytes::from(bad)).is_err());
    }

    #[test]
    fn a_settlement_s_columns_say_what_ended_and_for_how_long() {
        assert_eq!(
            settle_columns(&Settle::Sent {
                status: 201,
                keep: Duration::from_secs(2)
            }),
            ("sent", Some(201), None, Some(2000), None)
        );
        assert_eq!(
            settle_columns(&Settle::Retry {
                after: Duration::from_millis(5),
                error: "down".into()
            }),
            ("pending", None, Some("down"), None, Some(5))
        );
        assert_eq!(
            settle_columns(&Settle::Failed {
                status: Some(410),
                error: "gone".into(),
                keep: Duration::from_secs(1)
            }),
            ("failed", Some(410), Some("gone"), Some(1000), None)
        );
    }

    #[test]
    fn a_row_s_status_must_be_a_status() {
        assert!(answer_of(None, None, None).is_err());
        assert!(answer_of(Some(99), None, None).is_err());
        assert!(answer_of(Some(70_000), None, None).is_err());
        let answer = answer_of(Some(201), None, Some(b"{}".to_vec())).unwrap();
        assert_eq!(answer.status, StatusCode::CREATED);
        assert_eq!(answer.body.as_deref(), Some(&b"{}"[..]));
        assert!(fingerprint_of(&[0; 31]).is_err());
        assert_eq!(fingerprint_of(&[7; 32]).unwrap(), [7; 32]);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        let running = record_of(&[1; 32], "in_progress", None, None, None, -5, "a".into()).unwrap();
        assert_eq!(
            running.state,
            RecordState::InProgress {
                lease_left: Duration::ZERO
            }
        );
        let running =
            record_of(&[1; 32], "in_progress", None, None, None, 1200, "a".into()).unwrap();
        assert_eq!(
            running.state,
            RecordState::InProgress {
                lease_left: Duration::from_millis(1200)
            }
        );
        let done = record_of(
            &[2; 32],
            "completed",
            Some(201),
            None,
            Some(b"x".to_vec()),
            0,
            "b".into(),
        )
        .unwrap();
        assert_eq!(done.fingerprint, [2; 32]);
        assert_eq!(done.identity, "b");
        assert!(
            matches!(done.state, RecordState::Completed(ref a) if a.status == 201 && a.body.as_deref() == Some(&b"x"[..]))
        );
        assert!(record_of(&[2; 31], "completed", Some(201), None, None, 0, "c".into()).is_err());
        let failed = record_of(
            &[3; 32],
            "failed",
            Some(500),
            None,
            Some(b"p".to_vec()),
            0,
            "d".into(),
        )
        .unwrap();
        assert!(matches!(failed.state, RecordState::Completed(ref a) if a.status == 500));
        assert_eq!(millis(Duration::MAX), i64::MAX);
    }
}
