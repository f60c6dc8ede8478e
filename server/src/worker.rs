//! The loop every background worker (the reconciler, the relay, the sweeper) runs on tokio.

use std::future::Future;
use std::time::Duration;

use crate::events::{Event, EventLevels, emit};
use crate::store::StoreError;

/// Ticks every `every`, for ever: a tick that came back with a full `batch` is followed by
/// another at once; a failed one is logged (`worker_failed`, naming `worker`) and the next
/// interval tries again.
pub(crate) async fn tick_every<F, Fut>(
    every: Duration,
    batch: usize,
    worker: &'static str,
    mut tick: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<usize, StoreError>>,
{
    let levels = EventLevels::default();
    let mut interval = tokio::time::interval(every);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        loop {
            match tick().await {
                Ok(done) if done >= batch => continue,
                Ok(_) => break,
                Err(error) => {
                    emit!(levels, Event::WorkerFailed, worker, error = %error);
                    break;
                }
            }
        }
    }
}
