//! The layer's events: one `tracing` event per thing that happened, each at a level of its own
//! that the builder can change.
//!
//! Every event has target `safe_retry_server` and a field `event` holding its name; the fields
//! beside it are named alike everywhere (`scope`, `key`, `attempt`, `status`, `error`,
//! `point`, `id`). A reconciler's or relay's tick that found nothing logs nothing.

use tracing::Level;

/// An event the layer, its reconciler, its relay or its sweeper logs.
///
/// | event | level \[default\] | when | fields |
/// |---|---|---|---|
/// | `claim` | DEBUG | a request claimed a new record | scope, key |
/// | `takeover` | INFO | a request took over a record past its lease | scope, key, attempt |
/// | `completed` | DEBUG | an answer was stored with its local effects | scope, key, status |
/// | `replay` | INFO | a stored answer was sent again | scope, key, status |
/// | `in_progress` | INFO | a `409`: the key's first request is still running | scope, key |
/// | `mismatch` | INFO | a `422`: the key came with another request | scope, key |
/// | `rejected` | INFO | the handler rejected the request: nothing stored | scope, key, status |
/// | `refused` | INFO | a `400`, `401`, `408` or `413` before any claim | problem, detail |
/// | `unfinished` | INFO | an answer that is not an outcome (a recovery point, a store failure, a status not stored): the lease ended | scope, key, attempt, status |
/// | `step` | DEBUG | a recovery point committed | scope, key, point |
/// | `fenced` | WARN | a holder's write was refused: another attempt holds the record | scope, key, attempt |
/// | `abandoned` | INFO | a request ended without an outcome: its lease ended now | attempt |
/// | `abandon_failed` | WARN | ending that lease failed: it runs out instead | attempt, error |
/// | `store_failed` | WARN | a `503`: the store failed | error |
/// | `local_held` | ERROR | the handler answered while holding its `Local` | scope, key |
/// | `answer_failed` | ERROR | the handler's answer body failed | scope, key, error |
/// | `gave_up` | ERROR | a record started too often (or not resumable) ended failed | scope, key, attempt, detail |
/// | `reconciled` | INFO | a reconciler's tick resumed records (not logged when it found none) | found, completed, unfinished, failed, lost, store_failures |
/// | `relayed` | INFO | a relay's tick took messages (not logged when it took none) | taken, sent, retrying, failed, lost, store_failures |
/// | `delivered` | DEBUG | a message was delivered | id, status |
/// | `delivery_retry` | INFO | a message was not delivered; it is due again | id, delivery, error |
/// | `delivery_failed` | WARN | a message was refused, or out of deliveries | id, delivery, error |
/// | `swept` | INFO | a sweep deleted expired rows (not logged when it deleted none) | deleted |
/// | `worker_failed` | WARN | a reconciler's, relay's or sweeper's tick failed on the store | worker, error |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Event {
    /// A request claimed a new record.
    Claim,
    /// A request took over a record past its lease.
    Takeover,
    /// An answer was stored with its local effects.
    Completed,
    /// A stored answer was sent again.
    Replay,
    /// A `409`: the key's first request is still running.
    InProgress,
    /// A `422`: the key came with another request.
    Mismatch,
    /// The handler rejected the request; nothing was stored.
    Rejected,
    /// A request was refused before any claim.
    Refused,
    /// An answer that is not an outcome ended its lease with nothing stored.
    Unfinished,
    /// A recovery point committed.
    Step,
    /// A holder's write was refused: another attempt holds the record.
    Fenced,
    /// A request ended without an outcome; its lease ended now.
    Abandoned,
    /// Ending an abandoned lease failed; it runs out instead.
    AbandonFailed,
    /// The store failed; the request was answered `503`.
    StoreFailed,
    /// The handler answered while holding its `Local` transaction.
    LocalHeld,
    /// The handler's answer body failed.
    AnswerFailed,
    /// A record ended failed.
    GaveUp,
    /// A reconciler's tick resumed records.
    Reconciled,
    /// A relay's tick took messages.
    Relayed,
    /// A message was delivered.
    Delivered,
    /// A message was not delivered; it is due again.
    DeliveryRetry,
    /// A message was refused, or ran out of deliveries.
    DeliveryFailed,
    /// A sweep deleted expired rows.
    Swept,
    /// A worker's tick failed on the store.
    WorkerFailed,
}

const ALL: [Event; 24] = [
    Event::Claim,
    Event::Takeover,
    Event::Completed,
    Event::Replay,
    Event::InProgress,
    Event::Mismatch,
    Event::Rejected,
    Event::Refused,
    Event::Unfinished,
    Event::Step,
    Event::Fenced,
    Event::Abandoned,
    Event::AbandonFailed,
    Event::StoreFailed,
    Event::LocalHeld,
    Event::AnswerFailed,
    Event::GaveUp,
    Event::Reconciled,
    Event::Relayed,
    Event::Delivered,
    Event::DeliveryRetry,
    Event::DeliveryFailed,
    Event::Swept,
    Event::WorkerFailed,
];

impl Event {
    /// The event's name, as its `event` field holds it.
    pub fn name(self) -> &'static str {
        match self {
            Event::Claim => "claim",
            Event::Takeover => "takeover",
            Event::Completed => "completed",
            Event::Replay => "replay",
            Event::InProgress => "in_progress",
            Event::Mismatch => "mismatch",
            Event::Rejected => "rejected",
            Event::Refused => "refused",
            Event::Unfinished => "unfinished",
            Event::Step => "step",
            Event::Fenced => "fenced",
            Event::Abandoned => "abandoned",
            Event::AbandonFailed => "abandon_failed",
            Event::StoreFailed => "store_failed",
            Event::LocalHeld => "local_held",
            Event::AnswerFailed => "answer_failed",
            Event::GaveUp => "gave_up",
            Event::Reconciled => "reconciled",
            Event::Relayed => "relayed",
            Event::Delivered => "delivered",
            Event::DeliveryRetry => "delivery_retry",
            Event::DeliveryFailed => "delivery_failed",
            Event::Swept => "swept",
            Event::WorkerFailed => "worker_failed",
        }
    }

    /// The level the event is logged at unless the builder says otherwise.
    pub fn default_level(self) -> Level {
        match self {
            Event::Claim | Event::Completed | Event::Step | Event::Delivered => Level::DEBUG,
            Event::Fenced
            | Event::AbandonFailed
            | Event::StoreFailed
            | Event::DeliveryFailed
            | Event::WorkerFailed => Level::WARN,
            Event::LocalHeld | Event::AnswerFailed | Event::GaveUp => Level::ERROR,
            _ => Level::INFO,
        }
    }

    fn index(self) -> usize {
        ALL.iter().position(|e| *e == self).unwrap_or(0)
    }
}

/// The level of each event, as a layer logs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EventLevels([Level; ALL.len()]);

impl Default for EventLevels {
    fn default() -> EventLevels {
        EventLevels(ALL.map(Event::default_level))
    }
}

impl EventLevels {
    pub(crate) fn level(&self, event: Event) -> Level {
        self.0[event.index()]
    }

    pub(crate) fn set(&mut self, event: Event, level: Level) {
        self.0[event.index()] = level;
    }
}

/// Logs `event` at the level `levels` gives it, with target `safe_retry_server` and its name in
/// the field `event`, then the fields given.
macro_rules! emit {
    ($levels:expr, $event:expr, $($fields:tt)*) => {{
        let event: $crate::events::Event = $event;
        match $levels.level(event) {
            ::tracing::Level::ERROR => ::tracing::error!(target: "safe_retry_server", event = event.name(), $($fields)*),
            ::tracing::Level::WARN => ::tracing::warn!(target: "safe_retry_server", event = event.name(), $($fields)*),
            ::tracing::Level::INFO => ::tracing::info!(target: "safe_retry_server", event = event.name(), $($fields)*),
            ::tracing::Level::DEBUG => ::tracing::debug!(target: "safe_retry_server", event = event.name(), $($fields)*),
            _ => ::tracing::trace!(target: "safe_retry_server", event = event.name(), $($fields)*),
        }
    }};
}
pub(crate) use emit;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_has_its_own_name_and_a_level_that_can_be_changed() {
        let names: std::collections::HashSet<_> = ALL.iter().map(|e| e.name()).collect();
        assert_eq!(names.len(), ALL.len());
        for (i, event) in ALL.iter().enumerate() {
            assert_eq!(event.index(), i);
        }
        let mut levels = EventLevels::default();
        assert_eq!(levels.level(Event::Replay), Level::INFO);
        assert_eq!(levels.level(Event::InProgress), Level::INFO);
        assert_eq!(levels.level(Event::Claim), Level::DEBUG);
        assert_eq!(levels.level(Event::GaveUp), Level::ERROR);
        assert_eq!(levels.level(Event::StoreFailed), Level::WARN);
        levels.set(Event::Replay, Level::DEBUG);
        assert_eq!(levels.level(Event::Replay), Level::DEBUG);
        assert_eq!(levels.level(Event::InProgress), Level::INFO);
    }
}
