//! The claim: one atomic statement decides which request owns a record, and the hold that
//! ends the lease at once when its owner goes away without an outcome.

use std::sync::{Arc, Mutex};

use http::Response;

use crate::body::ReplyBody;
use crate::config::{Config, Count, Counters};
use crate::events::{Event, EventLevels};
use crate::store::{Claim, Claimed, Fence, RecordState, Store, StoreError};

use super::admission::Admitted;
use super::answers::{in_progress, mismatch, replay, unavailable};

/// What the claim came to: the record is this request's to run, or the request is answered.
pub(crate) enum Claiming<S: Store, R> {
    /// This request owns the execution.
    Owned(Owned<S>),
    /// Answered without running: a replay, a `409`, a `422`, or the store's failure.
    Answered(Response<ReplyBody<R>>),
}

/// A request its claim owns, on its way to the handler.
pub(crate) struct Owned<S: Store> {
    pub(crate) scope: Arc<str>,
    pub(crate) key: Arc<str>,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) claimed: Claimed,
    pub(crate) held: Held<S>,
}

/// How long a request whose claim failed waits to read its record for a replay.
const REPLAY_READ: std::time::Duration = std::time::Duration::from_millis(250);

/// Claims the request's record. A claim that does not win reads the record to learn why; a
/// record that changes between the two (a lease ending, a sweep) is claimed again, at most
/// three times. A record still in progress after the third (its holder's lease over, but its
/// row held by a transaction that has not ended) is answered `409`: a claim never waits on
/// another holder without a bound.
pub(crate) async fn claim<S: Store, R>(config: &Config<S>, admitted: &Admitted) -> Claiming<S, R> {
    let Admitted {
        scope,
        key,
        fingerprint,
        ..
    } = admitted;
    let claim = Claim {
        scope,
        key,
        fingerprint,
        lease: config.lease,
        retention: config.retention,
    };
    let held = Held::new(config);
    for _ in 0..3 {
        match held.claim(&claim).await {
            // The claim could not be written (the store is down, or SQLite's file is held by
            // another writer past the busy timeout): a completed record is still read, and a
            // copy of its request gets its replay.
            // The read is bounded on its own: a read cut short writes nothing.
            Err(error) => {
                let read = tokio::time::timeout(REPLAY_READ, config.store.read(scope, key));
                let answer = match read.await {
                    Ok(Ok(Some(record))) if record.fingerprint == *fingerprint => {
                        match record.state {
                            RecordState::Completed(stored) => replay(config, scope, key, &stored),
                            RecordState::InProgress { .. } => unavailable(config, &error),
                        }
                    }
                    _ => unavailable(config, &error),
                };
                return Claiming::Answered(answer);
            }
            Ok(Some(claimed)) => {
                return Claiming::Owned(Owned {
                    scope: scope.as_str().into(),
                    key: key.as_str().into(),
                    fingerprint: *fingerprint,
                    claimed,
                    held,
                });
            }
            Ok(None) => {}
        }
        let answer = match config.store.read(scope, key).await {
            Err(error) => unavailable(config, &error),
            Ok(None) => continue,
            Ok(Some(record)) if record.fingerprint != *fingerprint => mismatch(config, scope, key),
            Ok(Some(record)) => match record.state {
                RecordState::Completed(stored) => replay(config, scope, key, &stored),
                RecordState::InProgress { lease_left } if !lease_left.is_zero() => {
                    in_progress(config, scope, key)
                }
                RecordState::InProgress { .. } => continue,
            },
        };
        return Claiming::Answered(answer);
    }
    Claiming::Answered(in_progress(config, scope, key))
}

/// Where a request's claim stands, shared by the request's future and its claim's task.
enum Hold {
    /// The claim statement is on its way.
    Claiming,
    /// The request holds the record under this fence.
    Holding(Fence),
    /// The request went away (dropped, or failed without an outcome).
    Gone,
    /// The outcome is written (or the record released): nothing to end.
    Done,
}

/// The request's hold on its record. Dropped while it holds one (the handler failed, its
/// answer failed, or the request's future was dropped, even while the claim statement was on
/// its way), it ends the record's lease at once, fenced, so the next request with the key
/// takes it over instead of waiting the lease out.
pub(crate) struct Held<S: Store> {
    store: S,
    state: Arc<Mutex<Hold>>,
    counters: Arc<Counters>,
    events: Arc<EventLevels>,
}

fn lock(state: &Mutex<Hold>) -> std::sync::MutexGuard<'_, Hold> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<S: Store> Held<S> {
    pub(crate) fn new(config: &Config<S>) -> Held<S> {
        Held {
            store: config.store.clone(),
            state: Arc::new(Mutex::new(Hold::Claiming)),
            counters: config.counters.clone(),
            events: config.events.clone(),
        }
    }

    /// Runs the claim statement in a task of its own: if the request is dropped while the
    /// statement is on its way, the task ends the lease it took, so no record is left claimed
    /// with nobody holding it.
    pub(crate) async fn claim(&self, claim: &Claim<'_>) -> Result<Option<Claimed>, StoreError> {
        let (answer, heard) = tokio::sync::oneshot::channel();
        let (store, state, counters, events) = (
            self.store.clone(),
            self.state.clone(),
            self.counters.clone(),
            self.events.clone(),
        );
        let (scope, key, fingerprint) = (
            claim.scope.to_owned(),
            claim.key.to_owned(),
            *claim.fingerprint,
        );
        let (lease, retention) = (claim.lease, claim.retention);
        tokio::spawn(async move {
            let claim = Claim {
                scope: &scope,
                key: &key,
                fingerprint: &fingerprint,
                lease,
                retention,
            };
            let result = store.try_claim(&claim).await;
            if let Ok(Some(claimed)) = &result {
                let gone = {
                    let mut hold = lock(&state);
                    let gone = matches!(*hold, Hold::Gone);
                    if !gone {
                        *hold = Hold::Holding(claimed.fence);
                    }
                    gone
                };
                if gone {
                    abandon(store, claimed.fence, &counters, &events).await;
                    return;
                }
            }
            let _ = answer.send(result);
        });
        heard
            .await
            .unwrap_or_else(|_| Err(StoreError::new("the claim's task ended without an answer")))
    }

    /// Ends the lease now, while this request still holds it, before going on.
    pub(crate) async fn end_now(&self) {
        let holding = std::mem::replace(&mut *lock(&self.state), Hold::Done);
        if let Hold::Holding(fence) = holding {
            abandon(self.store.clone(), fence, &self.counters, &self.events).await;
        }
    }

    /// The outcome is written, or the record released.
    pub(crate) fn done(&self) {
        *lock(&self.state) = Hold::Done;
    }
}

async fn abandon<S: Store>(store: S, fence: Fence, counters: &Counters, events: &EventLevels) {
    counters.add(Count::Abandoned);
    crate::events::emit!(
        events,
        Event::Abandoned,
        attempt = fence.attempt,
        "the request ended without an outcome; its lease ends now"
    );
    if let Err(error) = store.abandon(fence).await {
        crate::events::emit!(events, Event::AbandonFailed, attempt = fence.attempt, error = %error, "the lease will run out instead");
    }
}

impl<S: Store> Drop for Held<S> {
    fn drop(&mut self) {
        let fence = match std::mem::replace(&mut *lock(&self.state), Hold::Gone) {
            Hold::Holding(fence) => fence,
            // A claim on its way sees `Gone` and ends its own lease; nothing else holds.
            Hold::Claiming | Hold::Gone | Hold::Done => return,
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, counters, events) = (
            self.store.clone(),
            self.counters.clone(),
            self.events.clone(),
        );
        runtime.spawn(async move { abandon(store, fence, &counters, &events).await });
    }
}
