//! Contention: clients racing for one resource that takes one write at a time.
//!
//! The setting of the classic study of exponential backoff and jitter: `clients` clients start
//! together, each needing one write. The resource is busy for `write_time` after a write begins;
//! a call that arrives while it is busy fails at once, and its client waits out a backoff before
//! calling again, until its write goes through. Without jitter the losers of each round come back
//! together and collide again; with jitter they spread out.
//!
//! A discrete-event simulation in virtual time: exact, and the same for the same seed.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

pub use reqwest_safe_retry::Jitter;
use reqwest_safe_retry::{RandomSource, SeededRng};

/// The four jitter strategies, in the order of the AWS study.
pub const JITTERS: [Jitter; 4] = [
    Jitter::None,
    Jitter::Equal,
    Jitter::Full,
    Jitter::Decorrelated,
];

/// A jitter strategy's short name, for tables and legends.
pub fn jitter_name(jitter: Jitter) -> &'static str {
    match jitter {
        Jitter::None => "no jitter",
        Jitter::Equal => "equal jitter",
        Jitter::Full => "full jitter",
        Jitter::Decorrelated => "decorrelated jitter",
        _ => "other jitter",
    }
}

/// The contention scenario's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contention {
    /// Clients that each need one write, all starting at time zero.
    pub clients: u32,
    /// How long one write holds the resource.
    pub write_time: Duration,
    /// The backoff base.
    pub base: Duration,
    /// The backoff cap.
    pub cap: Duration,
    /// How retries are spread.
    pub jitter: Jitter,
    /// Seeds the jitter.
    pub seed: u64,
}

/// What a contention run observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContentionReport {
    /// Calls made by all clients, successful or not.
    pub calls: u64,
    /// When the last client's write finished.
    pub completion: Duration,
    /// Clients that had not written when the run gave up (after 10,000 calls per client, as
    /// a strategy whose waits never spread the clients would never end): 0 for any strategy
    /// that works.
    pub unfinished: u32,
}

/// A wait drawn uniformly from `[0, max]`.
fn uniform(rng: &SeededRng, max: Duration) -> Duration {
    let span = u128::from(u64::try_from(max.as_nanos()).unwrap_or(u64::MAX)) + 1;
    let nanos = (u128::from(rng.next_u64()) * span) >> 64;
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// Calls per client after which a run gives up.
const MAX_CALLS_PER_CLIENT: u64 = 10_000;

impl Contention {
    /// The wait before retry `retry` (0 for the first) under the scenario's strategy, as the
    /// crate documents each [`Jitter`]: the ceiling `min(cap, base * 2^retry)`; none draws the
    /// ceiling itself, equal draws from its upper half, full from all of it, and decorrelated
    /// from `[base, 3 * previous]`, capped.
    fn backoff(&self, retry: u32, previous: Duration, rng: &SeededRng) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32.checked_shl(retry).unwrap_or(u32::MAX))
            .min(self.cap);
        match self.jitter {
            Jitter::None => ceiling,
            Jitter::Equal => ceiling / 2 + uniform(rng, ceiling - ceiling / 2),
            Jitter::Decorrelated => {
                let top = previous.saturating_mul(3).max(self.base);
                (self.base + uniform(rng, top - self.base)).min(self.cap)
            }
            _ => uniform(rng, ceiling),
        }
    }

    /// Runs until every client has written, or until the clients have made 10,000 calls each.
    pub fn run(&self) -> ContentionReport {
        let rng = SeededRng::new(self.seed);
        // (time of the next call, client); the heap pops the earliest, ties by client number.
        let mut calls: BinaryHeap<Reverse<(Duration, u32)>> = (0..self.clients)
            .map(|c| Reverse((Duration::ZERO, c)))
            .collect();
        let mut retries = vec![0u32; self.clients as usize];
        let mut previous = vec![self.base; self.clients as usize];
        let mut busy_until = Duration::ZERO;
        let (mut made, mut completion) = (0u64, Duration::ZERO);
        let limit = u64::from(self.clients).saturating_mul(MAX_CALLS_PER_CLIENT);
        while let Some(Reverse((at, client))) = calls.pop() {
            if made == limit {
                // Put it back: it is one of the clients that never wrote.
                calls.push(Reverse((at, client)));
                break;
            }
            made += 1;
            if at >= busy_until {
                busy_until = at + self.write_time;
                completion = completion.max(busy_until);
                continue;
            }
            let i = client as usize;
            let wait = self.backoff(retries[i], previous[i], &rng);
            previous[i] = wait;
            retries[i] = retries[i].saturating_add(1);
            calls.push(Reverse((at + wait, client)));
        }
        ContentionReport {
            calls: made,
            completion,
            unfinished: u32::try_from(calls.len()).unwrap_or(u32::MAX),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(clients: u32, jitter: Jitter) -> ContentionReport {
        Contention {
            clients,
            write_time: Duration::from_millis(10),
            base: Duration::from_millis(10),
            cap: Duration::from_secs(10),
            jitter,
            seed: 1,
        }
        .run()
    }

    #[test]
    fn one_client_writes_at_once() {
        for jitter in JITTERS {
            let report = run(1, jitter);
            assert_eq!(report.calls, 1);
            assert_eq!(report.completion, Duration::from_millis(10));
        }
    }

    #[test]
    fn without_jitter_two_clients_take_turns() {
        // Both call at 0: one writes until 10 ms; the other waits 10 ms and writes until 20 ms.
        let report = run(2, Jitter::None);
        assert_eq!(report.calls, 3);
        assert_eq!(report.completion, Duration::from_millis(20));
    }

    #[test]
    fn every_client_writes_exactly_once() {
        for jitter in JITTERS {
            let report = run(50, jitter);
            // Every client wrote (a client that has written makes no further call), the
            // writes never overlapped (50 of 10 ms each, one at a time), and the clients did
            // contend: more calls than writes, fewer than the run's limit.
            assert_eq!(report.unfinished, 0, "{jitter:?}");
            assert!(
                report.completion >= Duration::from_millis(500),
                "{jitter:?}"
            );
            assert!(report.calls > 50, "{jitter:?}: {report:?}");
            assert!(
                report.calls < 50 * MAX_CALLS_PER_CLIENT,
                "{jitter:?}: {report:?}"
            );
        }
    }

    #[test]
    fn waits_that_never_spread_the_clients_end_the_run_instead_of_looping() {
        let report = Contention {
            clients: 3,
            write_time: Duration::from_millis(10),
            base: Duration::ZERO,
            cap: Duration::ZERO,
            jitter: Jitter::Full,
            seed: 1,
        }
        .run();
        // One client writes at 0; the other two retry at 0 for ever, until the limit.
        assert_eq!(report.unfinished, 2);
        assert_eq!(report.calls, 3 * MAX_CALLS_PER_CLIENT);
    }
}
