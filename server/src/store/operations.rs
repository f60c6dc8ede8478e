//! What an operator reads and does on the outcome table: records listed by where they stand,
//! one record inspected, a parked record retried now, a record abandoned with a reason that is
//! kept. Never a saved request's headers or body, nor a stored answer's body: those may hold a
//! caller's secrets.

use std::future::Future;
use std::time::Duration;

use super::{Outcomes, StoreError, StoredAnswer};

/// Where a record stands, as an operator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Standing {
    /// In progress under a live lease: a holder is running it.
    Running,
    /// In progress past its lease with no recovery point: its holder went away before any step
    /// committed, so nothing of it ran outside its transaction; the client's retry runs it.
    Stalled,
    /// In progress past its lease at a recovery point: a step began or finished (its external
    /// call may have happened). The reconciler, or the client's retry, resumes it there; it is
    /// never swept nor renewed.
    Parked,
    /// Ended failed (started too often, or abandoned by an operator): every request with its
    /// key gets its failure until its retention ends.
    Failed,
    /// Completed, with its answer stored.
    Completed,
}

impl Standing {
    /// Every standing, in the order an operator reads them.
    pub const ALL: [Standing; 5] = [
        Standing::Parked,
        Standing::Stalled,
        Standing::Failed,
        Standing::Running,
        Standing::Completed,
    ];

    /// Its name: `running`, `stalled`, `parked`, `failed`, `completed`.
    pub fn name(self) -> &'static str {
        match self {
            Standing::Running => "running",
            Standing::Stalled => "stalled",
            Standing::Parked => "parked",
            Standing::Failed => "failed",
            Standing::Completed => "completed",
        }
    }

    /// The standing of a name, if it is one.
    pub fn of_name(name: &str) -> Option<Standing> {
        Standing::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Where a row stands from its status, its lease and its last recovery point.
    pub(crate) fn of(status: &str, lease_left_ms: i64, step: Option<&str>) -> Standing {
        match status {
            "completed" => Standing::Completed,
            "failed" => Standing::Failed,
            _ if lease_left_ms > 0 => Standing::Running,
            _ if step.is_some() => Standing::Parked,
            _ => Standing::Stalled,
        }
    }
}

/// A record as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordView {
    /// The caller's scope (empty under the shared scope).
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// Where it stands.
    pub standing: Standing,
    /// Its last recovery point (`charge:started`, `charge:done`), if it reached one.
    pub step: Option<String>,
    /// The committed steps' outputs, a JSON object by step name (what the handler chose to
    /// commit; kept until the record completes).
    pub steps: Option<String>,
    /// Whether a request is saved for a resumption (its method and target only are shown).
    pub request: Option<(String, String)>,
    /// Every start of the record so far (first run, takeovers, resumptions), renewals included.
    pub attempt: i64,
    /// The starts in its current generation, which `max_attempts` bounds.
    pub starts: i64,
    /// When it was created (its current generation), in milliseconds since the Unix epoch.
    pub created_at_ms: i64,
    /// When its retention ends, in milliseconds since the Unix epoch.
    pub expires_at_ms: i64,
    /// When its holder's lease ends (or ended), in milliseconds since the Unix epoch; none once
    /// it has ended.
    pub lease_ends_ms: Option<i64>,
    /// The stored answer's status, once it has one.
    pub answer_status: Option<u16>,
    /// Why an operator abandoned it.
    pub note: Option<String>,
}

/// How many records stand where.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// In progress under a live lease.
    pub running: u64,
    /// In progress past its lease, no recovery point.
    pub stalled: u64,
    /// In progress past its lease at a recovery point.
    pub parked: u64,
    /// Ended failed.
    pub failed: u64,
    /// Completed.
    pub completed: u64,
}

impl Tally {
    /// The count of one standing.
    pub fn of(&self, standing: Standing) -> u64 {
        match standing {
            Standing::Running => self.running,
            Standing::Stalled => self.stalled,
            Standing::Parked => self.parked,
            Standing::Failed => self.failed,
            Standing::Completed => self.completed,
        }
    }

    /// The tally of rows of (status, lease live 1/0, has a recovery point, count), as both
    /// stores' `GROUP BY` reads them.
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn of_rows(rows: Vec<(String, i64, bool, i64)>) -> Tally {
        let mut tally = Tally::default();
        for (status, live, stepped, n) in rows {
            let standing = Standing::of(&status, live, stepped.then_some(""));
            tally.add(standing, n.max(0) as u64);
        }
        tally
    }

    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn add(&mut self, standing: Standing, n: u64) {
        let slot = match standing {
            Standing::Running => &mut self.running,
            Standing::Stalled => &mut self.stalled,
            Standing::Parked => &mut self.parked,
            Standing::Failed => &mut self.failed,
            Standing::Completed => &mut self.completed,
        };
        *slot += n;
    }
}

/// The operator's queries and actions on an outcome table.
pub trait Operations: Outcomes {
    /// Up to `limit` records standing as `standing`, oldest first.
    fn records(
        &self,
        standing: Standing,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<RecordView>, StoreError>> + Send;

    /// The record of (scope, key), if there is one.
    fn inspect(
        &self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<RecordView>, StoreError>> + Send;

    /// How many records stand where.
    fn tally(&self) -> impl Future<Output = Result<Tally, StoreError>> + Send;

    /// Makes a stalled or parked record due now, its starts counted afresh: the reconciler's
    /// next tick (or the client's next retry) resumes it at its last recovery point. A record
    /// whose holder still runs (its lease live), or that has ended, is left alone: returns
    /// whether the record was made due.
    fn retry_now(
        &self,
        scope: &str,
        key: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Ends a stalled, parked or failed record `failed` with `answer` (what every later request
    /// with its key gets) for `retention` from now, keeping `reason` and its recovery points.
    /// A record whose holder still runs, or that completed, is left alone: returns whether the
    /// record was abandoned.
    fn abandon_record(
        &self,
        scope: &str,
        key: &str,
        reason: &str,
        answer: &StoredAnswer,
        retention: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// A record's view from a row's columns, as every store reads them: `scope`, `key`, `status`,
/// `step`, `steps`, `request`, `attempt`, `generation`, `created_ms`, `expires_ms`,
/// `lease_ms` (null once ended), `lease_left`, `response_status`, `note`.
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]
pub(crate) fn view_of<R>(row: &R) -> Result<RecordView, StoreError>
where
    R: sqlx::Row,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<i64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> &'r str: sqlx::ColumnIndex<R>,
{
    let status: String = row.try_get("status")?;
    let step: Option<String> = row.try_get("step")?;
    let lease_left: i64 = row.try_get("lease_left")?;
    let request = row.try_get::<Option<Vec<u8>>, _>("request")?.map(|bytes| {
        match super::decode_request(&bytes.into()) {
            Ok(saved) => (saved.method.to_string(), saved.target),
            Err(_) => ("?".to_owned(), "(does not decode)".to_owned()),
        }
    });
    let attempt: i64 = row.try_get("attempt")?;
    let generation: i64 = row.try_get("generation")?;
    Ok(RecordView {
        scope: row.try_get("scope")?,
        key: row.try_get("key")?,
        standing: Standing::of(&status, lease_left, step.as_deref()),
        step,
        steps: row.try_get("steps")?,
        request,
        attempt,
        starts: attempt - generation + 1,
        created_at_ms: row.try_get("created_ms")?,
        expires_at_ms: row.try_get("expires_ms")?,
        lease_ends_ms: row.try_get("lease_ms")?,
        answer_status: row
            .try_get::<Option<i64>, _>("response_status")?
            .and_then(|s| u16::try_from(s).ok()),
        note: row.try_get("note")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_stands_by_its_status_its_lease_and_its_recovery_point() {
        assert_eq!(Standing::of("completed", 0, None), Standing::Completed);
        assert_eq!(Standing::of("failed", 0, Some("a:done")), Standing::Failed);
        assert_eq!(
            Standing::of("in_progress", 1, Some("a:started")),
            Standing::Running
        );
        assert_eq!(
            Standing::of("in_progress", 0, Some("a:started")),
            Standing::Parked
        );
        assert_eq!(Standing::of("in_progress", 0, None), Standing::Stalled);
        for standing in Standing::ALL {
            assert_eq!(Standing::of_name(standing.name()), Some(standing));
            let mut tally = Tally::default();
            tally.add(standing, 3);
            assert_eq!(tally.of(standing), 3);
            assert_eq!(Standing::ALL.iter().map(|s| tally.of(*s)).sum::<u64>(), 3);
        }
        assert_eq!(Standing::of_name("lost"), None);
        let rows = vec![
            ("in_progress".to_owned(), 0, true, 2),
            ("in_progress".to_owned(), 1, true, 3),
            ("in_progress".to_owned(), 0, false, 4),
            ("failed".to_owned(), 0, true, 5),
            ("completed".to_owned(), 0, false, 6),
        ];
        let tally = Tally::of_rows(rows);
        assert_eq!(
            (
                tally.parked,
                tally.running,
                tally.stalled,
                tally.failed,
                tally.completed
            ),
            (2, 3, 4, 5, 6)
        );
    }
}
