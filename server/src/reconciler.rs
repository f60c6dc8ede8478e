//! The reconciler: finishes records whose holder stopped at a recovery point and whose client
//! never came back.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::body::{BoxError, SavedBody};
use crate::config::Config;
use crate::engine::{Ended, Held, Owned, Resumed, end_failed, execute};
use crate::events::{Event, emit};
use crate::layer::IdempotencyLayer;
use crate::store::{Claim, Stalled, Store, StoreError, decode_request};

/// Finishes requests that stopped part-way: records in progress past their lease that reached a
/// recovery point (so their request is saved). Each is claimed like a retry would claim it,
/// and its handler runs again from the first step not done, under the same layer settings.
///
/// Safe to run on every server of a fleet at once: a record is resumed by whichever claim wins
/// it, and the others pass it by. Make one with [`IdempotencyLayer::reconciler`], then call
/// [`tick`](Reconciler::tick) on a schedule of your own or [`run`](Reconciler::run) it on
/// tokio.
///
/// The handler runs on the saved request: its method, path and query, the headers the layer's
/// [`saved_headers`](crate::Builder::saved_headers) allow (never credentials), and its body. Extensions that layers outside this one set (an authenticated principal) are not
/// there: read the caller from [`Execution::scope`](crate::Execution::scope).
pub struct Reconciler<Svc, S> {
    config: Arc<Config<S>>,
    inner: Svc,
    batch: u32,
}

impl<Svc, S> fmt::Debug for Reconciler<Svc, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconciler")
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

/// What one [`tick`](Reconciler::tick) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReconcileReport {
    /// Stalled records found.
    pub found: usize,
    /// Resumed and completed: their answers are stored.
    pub completed: usize,
    /// Resumed and stopped again at a recovery point (a dependency still not answering).
    pub unfinished: usize,
    /// Resumed once more than the layer allows: ended `failed`.
    pub failed: usize,
    /// Passed by: another server or a client's retry claimed them first, or they finished
    /// meanwhile.
    pub lost: usize,
    /// Not resumed because the store failed.
    pub store_failures: usize,
}

impl<S: Store> IdempotencyLayer<S> {
    /// A reconciler for the requests this layer guards, running them on `inner`: the service
    /// the layer wraps (the handler, or an axum `Router` of the routes, with or without this
    /// layer on it), which takes requests whose body is a [`SavedBody`].
    pub fn reconciler<Svc>(&self, inner: Svc) -> Reconciler<Svc, S> {
        Reconciler {
            config: self.config.clone(),
            inner,
            batch: 32,
        }
    }
}

#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
impl<S: Store> crate::front::grpc::GrpcIdempotencyLayer<S> {
    /// A reconciler for the calls this layer guards, running them on `inner`: the tonic
    /// service the layer wraps (a generated `…Server`, or `tonic::service::Routes`, without
    /// this layer), which takes requests whose body is a [`SavedBody`].
    pub fn reconciler<Svc>(&self, inner: Svc) -> Reconciler<Svc, S> {
        Reconciler {
            config: self.config.clone(),
            inner,
            batch: 32,
        }
    }
}

impl<S: Store> crate::front::consumer::ConsumerLayer<S> {
    /// A reconciler for the messages this layer processes, running them on `inner`: the
    /// consumer's handler, which takes requests whose body is a [`SavedBody`]. A message it
    /// finishes is acknowledged when the broker delivers it again (its outcome is then
    /// replayed).
    pub fn reconciler<Svc>(&self, inner: Svc) -> Reconciler<Svc, S> {
        Reconciler {
            config: self.config.clone(),
            inner,
            batch: 32,
        }
    }
}

/// How one resumption ended.
enum Resumption {
    Ran(Ended),
    Lost,
    StoreFailed,
}

impl<Svc, S, R> Reconciler<Svc, S>
where
    Svc: Service<Request<SavedBody>, Response = Response<R>> + Clone + Send + 'static,
    Svc::Future: Send,
    Svc::Error: Send,
    S: Store,
    R: Body<Data = Bytes> + Unpin + Send + 'static,
    R::Error: Into<BoxError>,
{
    /// How many stalled records one tick resumes at most, concurrently \[32\].
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Finds up to a batch of stalled records and resumes each, concurrently. A tick that
    /// reports `found` equal to the batch left more behind: tick again.
    pub async fn tick(&self) -> Result<ReconcileReport, StoreError> {
        let stalled = self.config.store.stalled(self.batch).await?;
        let mut report = ReconcileReport {
            found: stalled.len(),
            ..ReconcileReport::default()
        };
        let mut running = tokio::task::JoinSet::new();
        for record in stalled {
            running.spawn(resume::<_, _, SavedBody, R>(
                self.config.clone(),
                self.inner.clone(),
                record,
            ));
        }
        while let Some(done) = running.join_next().await {
            match done {
                Ok(Resumption::Ran(Ended::Completed)) => report.completed += 1,
                Ok(Resumption::Ran(Ended::Failed)) => report.failed += 1,
                Ok(Resumption::Ran(Ended::Fenced)) | Ok(Resumption::Lost) => report.lost += 1,
                Ok(Resumption::Ran(Ended::StoreFailed)) | Ok(Resumption::StoreFailed) => {
                    report.store_failures += 1
                }
                // A rejection on a resumption deleted the record: nothing is left to finish.
                Ok(Resumption::Ran(Ended::Unfinished | Ended::Rejected)) | Err(_) => {
                    report.unfinished += 1
                }
            }
        }
        if report.found > 0 {
            let r = report;
            emit!(
                self.config.events,
                Event::Reconciled,
                found = r.found,
                completed = r.completed,
                unfinished = r.unfinished,
                failed = r.failed,
                lost = r.lost,
                store_failures = r.store_failures
            );
        }
        Ok(report)
    }

    /// Ticks every `every`, for ever (a tick that fills its batch is followed by another at
    /// once). Store failures are logged and the next tick tries again. Spawn it on tokio and
    /// abort the task to stop it.
    pub async fn run(self, every: Duration) {
        let batch = self.batch as usize;
        crate::worker::tick_every(every, batch, "reconciler", || async {
            self.tick().await.map(|report| report.found)
        })
        .await
    }
}

async fn resume<Svc, S, B, R>(config: Arc<Config<S>>, mut inner: Svc, record: Stalled) -> Resumption
where
    Svc: Service<Request<B>, Response = Response<R>>,
    S: Store,
    B: From<Bytes>,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let held = Held::new(&config);
    let claim = Claim {
        scope: &record.scope,
        key: &record.key,
        fingerprint: &record.fingerprint,
        lease: config.lease,
        retention: config.retention,
    };
    let claimed = match held.claim(&claim).await {
        Err(_) => return Resumption::StoreFailed,
        Ok(None) => return Resumption::Lost,
        Ok(Some(claimed)) => claimed,
    };
    // From here `held` ends the lease if the resumption stops without an outcome.
    let saved = match config.store.progress(claimed.fence).await {
        Err(_) => return Resumption::StoreFailed,
        Ok(progress) => progress.request,
    };
    let Some(saved) = saved else {
        // The record was renewed (its retention ended) between the search and the claim: this
        // claim made it new, and nothing ran under it.
        let _ = config.store.release(None, claimed.fence).await;
        held.done();
        return Resumption::Lost;
    };
    let owned = Owned {
        scope: record.scope.into(),
        key: record.key.into(),
        fingerprint: record.fingerprint,
        claimed,
        held,
    };
    let decoded = decode_request(&saved).and_then(|saved| {
        let uri = saved
            .target
            .parse::<http::Uri>()
            .map_err(|_| StoreError::new("a saved request's target is not a URI"))?;
        Ok((saved, uri))
    });
    let (saved, uri) = match decoded {
        Ok(decoded) => decoded,
        Err(error) => {
            // Never resumable: end it failed rather than find it again on every tick.
            let detail = format!("the request could not be resumed: {error}");
            let (_, ended) = end_failed::<S, R>(&config, &owned, &detail).await;
            return Resumption::Ran(ended);
        }
    };
    let mut request = Request::new(B::from(saved.body.clone()));
    *request.method_mut() = saved.method;
    *request.uri_mut() = uri;
    for (name, value) in saved.headers {
        request.headers_mut().append(name, value);
    }
    request.extensions_mut().insert(Resumed);
    if std::future::poll_fn(|cx| inner.poll_ready(cx))
        .await
        .is_err()
    {
        return Resumption::Ran(Ended::Unfinished);
    }
    let (parts, body) = request.into_parts();
    drop(body);
    match execute::<_, _, B, R>(&config, inner, parts, saved.body, B::from, owned).await {
        Ok((_, ended)) => Resumption::Ran(ended),
        Err(_) => Resumption::Ran(Ended::Unfinished),
    }
}
