//! What a handler sees of the layer: the execution it owns, the transaction its local effects
//! commit in, and the marker that says "I rejected this before doing anything".

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};
use serde_json::{Map, Value};

use crate::config::Counters;
use crate::events::EventLevels;
use crate::store::{Fence, Store, StoreError};

/// What a request's steps share: the outputs committed so far and whether the request is saved.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    /// Read from the store (or known empty, for a record this request created).
    pub(crate) loaded: bool,
    /// The committed steps' outputs by name.
    pub(crate) steps: Map<String, Value>,
    /// The record holds the request a resumption runs again.
    pub(crate) request_saved: bool,
}

/// The request as a resumption runs it again, kept until the first recovery point saves it.
pub(crate) struct Snapshot {
    method: Method,
    uri: http::Uri,
    headers: http::HeaderMap,
    /// The headers a saved request may keep (`Builder::saved_headers`).
    saved: Arc<[HeaderName]>,
    body: Bytes,
}

impl Snapshot {
    /// The request as it arrived (cheap: its parts are reference-counted); what a resumption
    /// may keep of it is picked when the first recovery point saves it.
    pub(crate) fn of(
        parts: &http::request::Parts,
        body: &Bytes,
        saved: &Arc<[HeaderName]>,
    ) -> Snapshot {
        Snapshot {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers: parts.headers.clone(),
            saved: saved.clone(),
            body: body.clone(),
        }
    }

    /// The saved form: the method, the target (path and query), the allow-listed headers and
    /// the body.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let target = self
            .uri
            .path_and_query()
            .map_or_else(|| self.uri.path(), |pq| pq.as_str());
        let mut headers: Vec<(HeaderName, HeaderValue)> = Vec::new();
        for name in self.saved.iter() {
            for value in self.headers.get_all(name) {
                headers.push((name.clone(), value.clone()));
            }
        }
        crate::store::encode_request(&self.method, target, &headers, &self.body)
    }
}

/// Where the handler's transaction is.
enum Slot<T> {
    /// Not begun.
    Idle,
    /// Begun and back in the slot: the layer completes in it.
    Open(T),
    /// Held by a [`Local`] (or being begun).
    Lent,
    /// The layer has taken it for the completion; a `Local` still out rolls back on drop.
    Closed,
}

/// The execution a request owns, put in the request's extensions by the layer: the key and
/// scope it runs under, the attempt that holds it, and the way to the transaction that its
/// local effects share with the stored answer.
///
/// Under axum it is an extractor; elsewhere read it with
/// `request.extensions().get::<Execution<S>>()`.
pub struct Execution<S: Store> {
    inner: Arc<Inner<S>>,
}

pub(crate) struct Inner<S: Store> {
    pub(crate) store: S,
    slot: Arc<Mutex<Slot<S::Tx>>>,
    scope: Arc<str>,
    key: Arc<str>,
    pub(crate) identity: Arc<str>,
    pub(crate) fence: Fence,
    taken_over: bool,
    pub(crate) lease: Duration,
    pub(crate) counters: Arc<Counters>,
    pub(crate) events: Arc<EventLevels>,
    pub(crate) journal: Mutex<Journal>,
    pub(crate) snapshot: Snapshot,
}

impl<S: Store> Clone for Execution<S> {
    fn clone(&self) -> Self {
        Execution {
            inner: self.inner.clone(),
        }
    }
}

impl<S: Store> fmt::Debug for Execution<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Execution")
            .field("scope", &self.inner.scope)
            .field("key", &self.inner.key)
            .field("fence", &self.inner.fence)
            .field("taken_over", &self.inner.taken_over)
            .finish_non_exhaustive()
    }
}

fn lock<T>(slot: &Mutex<T>) -> MutexGuard<'_, T> {
    slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What the layer knows of a claimed request when it hands it to the handler.
pub(crate) struct Claimed {
    pub(crate) scope: Arc<str>,
    pub(crate) key: Arc<str>,
    /// The record's identity: what its downstream keys derive from.
    pub(crate) identity: Arc<str>,
    pub(crate) fence: Fence,
    pub(crate) taken_over: bool,
    pub(crate) lease: Duration,
    pub(crate) counters: Arc<Counters>,
    pub(crate) snapshot: Snapshot,
    pub(crate) events: Arc<EventLevels>,
}

impl<S: Store> Execution<S> {
    pub(crate) fn new(store: S, claimed: Claimed) -> Self {
        // A record this request created has no steps to read.
        let journal = Journal {
            loaded: !claimed.taken_over,
            ..Journal::default()
        };
        Execution {
            inner: Arc::new(Inner {
                store,
                slot: Arc::new(Mutex::new(Slot::Idle)),
                scope: claimed.scope,
                key: claimed.key,
                identity: claimed.identity,
                fence: claimed.fence,
                taken_over: claimed.taken_over,
                lease: claimed.lease,
                counters: claimed.counters,
                events: claimed.events,
                journal: Mutex::new(journal),
                snapshot: claimed.snapshot,
            }),
        }
    }

    pub(crate) fn inner(&self) -> &Inner<S> {
        &self.inner
    }

    /// The request's idempotency key.
    pub fn key(&self) -> &str {
        &self.inner.key
    }

    /// The caller's scope the key belongs to.
    pub fn scope(&self) -> &str {
        &self.inner.scope
    }

    /// The attempt that holds the record: 1 for the first, one more for each takeover.
    pub fn attempt(&self) -> i64 {
        self.inner.fence.attempt
    }

    /// Whether this execution took the record over from a holder whose lease ran out: an
    /// earlier attempt may have done part of the work.
    pub fn taken_over(&self) -> bool {
        self.inner.taken_over
    }

    /// The transaction the handler's local effects commit in, together with the stored answer:
    /// both commit, or neither. Begun on the first call; a later call (after the first
    /// [`Local`] is dropped) continues the same transaction.
    pub async fn local(&self) -> Result<Local<S>, LocalError> {
        let begun = {
            let mut slot = lock(&self.inner.slot);
            match std::mem::replace(&mut *slot, Slot::Lent) {
                Slot::Open(tx) => Some(tx),
                Slot::Idle => None,
                Slot::Lent => return Err(LocalError::AlreadyHeld),
                Slot::Closed => {
                    *slot = Slot::Closed;
                    return Err(LocalError::Finished);
                }
            }
        };
        let tx = match begun {
            Some(tx) => tx,
            None => match self.inner.store.begin().await {
                Ok(tx) => tx,
                Err(error) => {
                    let mut slot = lock(&self.inner.slot);
                    if matches!(*slot, Slot::Lent) {
                        *slot = Slot::Idle;
                    }
                    return Err(LocalError::Store(error));
                }
            },
        };
        Ok(Local {
            tx: Some(tx),
            slot: self.inner.slot.clone(),
        })
    }

    /// Takes the transaction for the completion. `Err(())` when a [`Local`] is still held.
    pub(crate) fn close(&self) -> Result<Option<S::Tx>, ()> {
        match std::mem::replace(&mut *lock(&self.inner.slot), Slot::Closed) {
            Slot::Idle | Slot::Closed => Ok(None),
            Slot::Open(tx) => Ok(Some(tx)),
            Slot::Lent => Err(()),
        }
    }
}

/// The handler's transaction: dereferences to the store's transaction type
/// (`sqlx::Transaction<'static, Sqlite>` or `<Postgres>`), so `query.execute(&mut **local)`
/// writes in it. Do not commit it: the layer commits it with the stored answer (or rolls it
/// back when the record was taken over). Drop it before the handler returns.
pub struct Local<S: Store> {
    tx: Option<S::Tx>,
    slot: Arc<Mutex<Slot<S::Tx>>>,
}

impl<S: Store> Deref for Local<S> {
    type Target = S::Tx;

    fn deref(&self) -> &S::Tx {
        self.tx
            .as_ref()
            .expect("a Local holds its transaction until dropped")
    }
}

impl<S: Store> DerefMut for Local<S> {
    fn deref_mut(&mut self) -> &mut S::Tx {
        self.tx
            .as_mut()
            .expect("a Local holds its transaction until dropped")
    }
}

impl<S: Store> Drop for Local<S> {
    fn drop(&mut self) {
        let mut slot = lock(&self.slot);
        if matches!(*slot, Slot::Lent)
            && let Some(tx) = self.tx.take()
        {
            *slot = Slot::Open(tx);
        }
        // Closed: the layer finished without it; the transaction rolls back as it drops.
    }
}

impl<S: Store> fmt::Debug for Local<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Local(..)")
    }
}

/// Why a handler could not get its [`Local`] transaction.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LocalError {
    /// Another [`Local`] of this request is still held.
    #[error("this request's transaction is already held by another Local; drop it first")]
    AlreadyHeld,
    /// The layer has finished with this request.
    #[error("this request's execution has finished")]
    Finished,
    /// The layer is not on this route or method.
    #[error("no idempotent execution on this request: put the layer on this route and method")]
    NoExecution,
    /// The store could not begin a transaction.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl LocalError {
    /// The answer for a caller whose handler could not get its transaction, marked
    /// [`Unfinished`](crate::Unfinished): nothing is stored, the lease ends at once, and a
    /// retry with the same key runs the handler again. The store's failure is `503`
    /// `store-unavailable` with a retry hint (the driver's error text stays in the logs);
    /// a misuse of the layer is `500` `handler-failed`.
    pub fn response(&self) -> http::Response<Bytes> {
        let mut response = match self {
            LocalError::Store(_) => crate::problem::Problem::store_unavailable(),
            _ => crate::problem::Problem::HandlerFailed.response(&self.to_string()),
        };
        response.extensions_mut().insert(crate::markers::Unfinished);
        response
    }
}

impl StoreError {
    /// The answer for a caller whose handler met this error (a query in its `Local`
    /// transaction that failed), marked [`Unfinished`](crate::Unfinished): `503`
    /// `store-unavailable` with a retry hint and without the driver's text; nothing is stored
    /// and the lease ends at once.
    pub fn response(&self) -> http::Response<Bytes> {
        let mut response = crate::problem::Problem::store_unavailable();
        response.extensions_mut().insert(crate::markers::Unfinished);
        response
    }
}

pub use crate::markers::Rejected;

#[cfg(feature = "axum")]
mod axum_parts {
    use super::*;
    use axum_core::extract::FromRequestParts;
    use axum_core::response::{IntoResponseParts, Response, ResponseParts};
    use http::request::Parts;

    impl IntoResponseParts for Rejected {
        type Error = std::convert::Infallible;

        fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
            res.extensions_mut().insert(Rejected);
            Ok(res)
        }
    }

    impl LocalError {
        fn into_problem(self) -> Response {
            axum_core::response::IntoResponse::into_response(self)
        }
    }

    impl axum_core::response::IntoResponse for LocalError {
        fn into_response(self) -> Response {
            let (parts, body) = self.response().into_parts();
            Response::from_parts(parts, axum_core::body::Body::from(body))
        }
    }

    impl axum_core::response::IntoResponse for StoreError {
        fn into_response(self) -> Response {
            let (parts, body) = self.response().into_parts();
            Response::from_parts(parts, axum_core::body::Body::from(body))
        }
    }

    impl<St: Sync, S: Store> FromRequestParts<St> for Execution<S> {
        type Rejection = Response;

        async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Self, Response> {
            parts
                .extensions
                .get::<Execution<S>>()
                .cloned()
                .ok_or_else(|| LocalError::NoExecution.into_problem())
        }
    }

    /// The handler's transaction as an extractor: fails with a `500` problem when the layer is
    /// not on the route, and a `503` when the store cannot begin a transaction; neither is
    /// stored (see [`LocalError::response`]).
    impl<St: Sync, S: Store> FromRequestParts<St> for Local<S> {
        type Rejection = Response;

        async fn from_request_parts(parts: &mut Parts, state: &St) -> Result<Self, Response> {
            let execution = Execution::<S>::from_request_parts(parts, state).await?;
            execution.local().await.map_err(LocalError::into_problem)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::markers::Unfinished;

    #[test]
    fn a_failed_store_is_answered_503_unfinished_without_the_driver_s_text() {
        let store = StoreError::new("database is locked");
        let local = LocalError::Store(StoreError::new("pool timed out"));
        for response in [store.response(), local.response()] {
            assert_eq!(response.status(), 503);
            assert!(response.extensions().get::<Unfinished>().is_some());
            assert_eq!(response.headers()["retry-after"], "1");
            let body = String::from_utf8_lossy(response.body()).into_owned();
            assert!(body.contains("store-unavailable"), "{body}");
            assert!(!body.contains("locked") && !body.contains("pool"), "{body}");
        }
        for misuse in [
            LocalError::AlreadyHeld,
            LocalError::Finished,
            LocalError::NoExecution,
        ] {
            let response = misuse.response();
            assert_eq!(response.status(), 500, "{misuse:?}");
            assert!(response.extensions().get::<Unfinished>().is_some());
        }
    }

    #[cfg(feature = "axum")]
    #[test]
    fn as_axum_responses_they_keep_their_status_and_their_marker() {
        use axum_core::response::IntoResponse;
        let store = StoreError::new("database is locked").into_response();
        assert_eq!(store.status(), 503);
        assert!(store.extensions().get::<Unfinished>().is_some());
        let local = LocalError::NoExecution.into_response();
        assert_eq!(local.status(), 500);
        assert!(local.extensions().get::<Unfinished>().is_some());
    }
}
