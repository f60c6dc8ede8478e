//! The sweeper: deletes what the retention no longer keeps, in bounded batches, on a schedule.

use std::fmt;
use std::time::Duration;

use crate::events::{Event, EventLevels, emit};
use crate::store::{Outcomes, StoreError};

/// Deletes expired records (completed ones past their retention, failed ones past theirs,
/// in-progress ones whose retention and lease have both ended) and ended outbox messages past
/// theirs, at most a batch per statement. Safe on every server of a fleet at once.
///
/// Make one with [`Sweeper::new`], then [`run`](Sweeper::run) it on tokio, or call
/// [`tick`](Sweeper::tick) from a scheduler of your own.
#[derive(Clone)]
pub struct Sweeper<S> {
    store: S,
    batch: u32,
}

impl<S> fmt::Debug for Sweeper<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sweeper")
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

/// What one [`tick`](Sweeper::tick) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweepReport {
    /// Rows deleted (records and messages). A tick that deleted a full batch left more behind.
    pub deleted: u64,
}

impl<S: Outcomes> Sweeper<S> {
    /// A sweeper of `store`'s table and outbox.
    pub fn new(store: S) -> Sweeper<S> {
        Sweeper { store, batch: 500 }
    }

    /// How many rows of each table one statement deletes at most \[500\]: short statements
    /// that hold no lock for long.
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// Deletes at most a batch of each.
    pub async fn tick(&self) -> Result<SweepReport, StoreError> {
        let deleted = self.store.sweep(self.batch).await?;
        if deleted > 0 {
            emit!(EventLevels::default(), Event::Swept, deleted);
        }
        Ok(SweepReport { deleted })
    }

    /// Ticks every `every`, for ever (a tick that fills its batch is followed by another at
    /// once). Store failures are logged and the next tick tries again. Spawn it on tokio and
    /// abort the task to stop it.
    pub async fn run(self, every: Duration) {
        let batch = self.batch as usize;
        crate::worker::tick_every(every, batch, "sweeper", || async {
            self.tick()
                .await
                .map(|report| usize::try_from(report.deleted).unwrap_or(usize::MAX))
        })
        .await
    }
}
