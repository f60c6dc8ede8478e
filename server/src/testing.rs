//! Helpers for testing a service behind the layer (feature `test-util`): crash points a test
//! arms in its handler, to prove that a crash at any recovery point leaves one effect.
//!
//! A handler calls [`Crashes::point`] at each place a process could die (after a step's
//! external call, before its commit, ...). A test arms one point, sends a request, waits until
//! the handler is there, and then ends the request as a crash would: it drops the request (the
//! layer ends the lease at once, as it does for a caller that hangs up) or lets the lease run
//! out (as after a killed process). A reconciler's tick, or the client's retry, then finishes
//! the record, and the test counts the effects.
//!
//! ```
//! # #[cfg(all(feature = "sqlite", feature = "axum"))]
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::collections::HashSet;
//! use std::sync::{Arc, Mutex};
//! use axum::{Extension, Router, extract::State, routing::post};
//! use http::{Request, StatusCode};
//! use safe_retry_server::testing::{Crash, Crashes};
//! use safe_retry_server::{Execution, IdempotencyLayer, SqliteStore, Step, StepError};
//! use tower_service::Service;
//!
//! /// The provider, as a set of the keys it charged: it dedupes on the step's key.
//! type Provider = Arc<Mutex<HashSet<String>>>;
//!
//! async fn order(
//!     State((crashes, provider)): State<(Arc<Crashes>, Provider)>,
//!     Extension(execution): Extension<Execution<SqliteStore>>,
//! ) -> Result<&'static str, StepError> {
//!     if let Step::Todo(step) = execution.step::<()>("charge").await? {
//!         provider.lock().unwrap().insert(step.natural_key());
//!         crashes.point("after-charge").await?; // the process could die here
//!         step.commit(()).await?;
//!     }
//!     Ok("ordered")
//! }
//!
//! let (crashes, provider) = (Arc::new(Crashes::new()), Provider::default());
//! let layer = IdempotencyLayer::builder(SqliteStore::memory().await?)
//!     .shared_scope()
//!     .build()?;
//! let mut app = Router::new()
//!     .route("/orders", post(order))
//!     .layer(layer)
//!     .with_state((crashes.clone(), provider.clone()));
//! let send = || {
//!     let request = Request::post("/orders").header("idempotency-key", "k-1");
//!     request.body(axum::body::Body::empty())
//! };
//!
//! crashes.arm("after-charge", Crash::Fail);
//! let crashed = app.call(send()?).await?;
//! assert_eq!(crashed.status(), StatusCode::SERVICE_UNAVAILABLE); // not stored
//! let retried = app.call(send()?).await?;
//! assert_eq!(retried.status(), StatusCode::OK);
//! // Charged twice under one key: one charge at the provider.
//! assert_eq!(provider.lock().unwrap().len(), 1);
//! # Ok(()) }
//! # #[cfg(not(all(feature = "sqlite", feature = "axum")))] fn main() {}
//! ```

use std::sync::Mutex;

use tokio::sync::Semaphore;

use crate::step::StepError;
use crate::store::StoreError;

/// What an armed crash point does when the handler reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Crash {
    /// The handler fails there without an outcome ([`StepError::Store`], answered `503`): as
    /// an exception would end it. Its step's transaction rolls back and its lease ends.
    Fail,
    /// The handler stops there for ever: the test then drops the request, or kills the
    /// process, as a crash would.
    Hang,
    /// The handler waits there until [`Crashes::resume`], then goes on: a holder that wakes
    /// after another took its record over (a paused process, a long GC pause).
    Pause,
}

/// The crash points of a handler under test: one armed at a time, firing once.
#[derive(Debug)]
pub struct Crashes {
    armed: Mutex<Option<(String, Crash)>>,
    reached: Semaphore,
    resume: Semaphore,
    announce: bool,
}

impl Default for Crashes {
    fn default() -> Crashes {
        Crashes {
            armed: Mutex::new(None),
            reached: Semaphore::new(0),
            resume: Semaphore::new(0),
            announce: false,
        }
    }
}

impl Crashes {
    /// Crash points with none armed.
    pub fn new() -> Crashes {
        Crashes::default()
    }

    /// Crash points that also print `reached POINT` on stdout when an armed point is reached:
    /// for a test that runs the service as a process and kills it there (SIGKILL).
    pub fn announced() -> Crashes {
        Crashes {
            announce: true,
            ..Crashes::default()
        }
    }

    /// Arms `crash` at `point`, for the next request that reaches it.
    pub fn arm(&self, point: &str, crash: Crash) {
        *lock(&self.armed) = Some((point.to_owned(), crash));
    }

    /// Disarms the armed point, if any.
    pub fn disarm(&self) {
        *lock(&self.armed) = None;
    }

    /// Whether a point is still armed (it has not been reached since it was armed).
    pub fn is_armed(&self) -> bool {
        lock(&self.armed).is_some()
    }

    /// A crash point: call it in the handler where a process could die. It returns at once
    /// unless `point` is armed; then it does what the [`Crash`] says, once.
    pub async fn point(&self, point: &str) -> Result<(), StepError> {
        let crash = {
            let mut armed = lock(&self.armed);
            match armed.as_ref() {
                Some((at, _)) if at == point => armed.take().map(|(_, crash)| crash),
                _ => None,
            }
        };
        let Some(crash) = crash else { return Ok(()) };
        if self.announce {
            use std::io::Write;
            println!("reached {point}");
            let _ = std::io::stdout().flush();
        }
        self.reached.add_permits(1);
        match crash {
            Crash::Fail => Err(StepError::Store(StoreError::new(format!(
                "a crash injected at {point}"
            )))),
            Crash::Hang => std::future::pending().await,
            Crash::Pause => {
                let _ = self.resume.acquire().await.map(|permit| permit.forget());
                Ok(())
            }
        }
    }

    /// Waits until an armed point has been reached (once for each time one was). Bound it with
    /// the test's own timeout.
    pub async fn reached(&self) {
        let _ = self.reached.acquire().await.map(|permit| permit.forget());
    }

    /// Lets a handler paused at a [`Crash::Pause`] point go on.
    pub fn resume(&self) {
        self.resume.add_permits(1);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_armed_point_fires_once_and_others_pass() {
        let crashes = Crashes::new();
        assert!(crashes.point("a").await.is_ok());
        crashes.arm("a", Crash::Fail);
        assert!(crashes.is_armed());
        assert!(crashes.point("b").await.is_ok(), "another point passes");
        assert!(matches!(crashes.point("a").await, Err(StepError::Store(_))));
        assert!(!crashes.is_armed());
        assert!(crashes.point("a").await.is_ok(), "fired once");
        tokio::time::timeout(std::time::Duration::from_secs(1), crashes.reached())
            .await
            .expect("reached once");
        crashes.arm("a", Crash::Pause);
        crashes.disarm();
        assert!(crashes.point("a").await.is_ok());
    }

    #[tokio::test]
    async fn a_paused_point_goes_on_when_resumed_and_a_hung_one_never() {
        let crashes = std::sync::Arc::new(Crashes::new());
        crashes.arm("p", Crash::Pause);
        let paused = tokio::spawn({
            let crashes = crashes.clone();
            async move { crashes.point("p").await.is_ok() }
        });
        let within = std::time::Duration::from_secs(5);
        tokio::time::timeout(within, crashes.reached())
            .await
            .expect("the paused point is reached");
        assert!(!paused.is_finished());
        crashes.resume();
        let went_on = tokio::time::timeout(within, paused).await;
        assert!(went_on.expect("resumed within 5 s").unwrap());
        crashes.arm("h", Crash::Hang);
        let hung = crashes.point("h");
        let waited = tokio::time::timeout(std::time::Duration::from_millis(20), hung).await;
        assert!(waited.is_err(), "a hung point never returns");
    }
}
