//! A6's retry throttling: a token count per server (or channel) that failures spend and successes
//! refill, below half of which no call is retried.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::engine::grpc::CodeSet;
use crate::error::InvalidConfig;

/// The area named in this module's configuration errors.
const AREA: &str = "gRPC retry throttling";

/// gRPC's retry throttling (gRFC A6's `retryThrottling`): the same guarantee as a
/// [`RetryBudget`](crate::RetryBudget), that retries cannot multiply an outage, by gRPC's own
/// rule. A6 counts it per server: the services a layer makes around channels to one server
/// (`layer.layer(channel)`, the server named by
/// [`GrpcRetryLayer::with_target`](crate::grpc::GrpcRetryLayer::with_target)) share one count,
/// as gRPC's C core keeps one per server name, with their clones and every method called
/// through them; a channel to another server never shares it, even one made from a clone of
/// the same [`GrpcConfig`](crate::grpc::GrpcConfig). A layer with no target names no server:
/// each service it makes keeps a count of its own.
///
/// The count starts at `max_tokens`. Every attempt that fails with a status its policy retries
/// takes 1 from it (down to 0); every call that ends `OK` adds `token_ratio` (up to
/// `max_tokens`). While the count is at or below half of `max_tokens`, no call is retried: the
/// attempt that failed is the call's last. Counted in thousandths of a token, as gRPC's own
/// clients count (a ratio is read to three decimal places).
///
/// ```
/// use reqwest_safe_retry::grpc::RetryThrottling;
///
/// let throttling = RetryThrottling::new(10.0, 0.1)?;
/// assert_eq!(throttling.tokens(), 10.0);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
#[derive(Debug, Clone)]
pub struct RetryThrottling {
    /// In thousandths.
    max: u64,
    ratio: u64,
    /// The count this value spends and refills: one channel's.
    tokens: Arc<AtomicU64>,
    /// The channels made from this value and its clones, for [`tokens`](Self::tokens) to
    /// read.
    channels: Arc<Mutex<Channels>>,
}

/// The counts of the channels made from one throttling: those alive, each named server's, and
/// the last one made, kept after its channel is gone so that its count can still be read.
#[derive(Debug, Default)]
struct Channels {
    alive: Vec<Weak<AtomicU64>>,
    /// The count of each server named by the layers' target, while a channel to it is alive.
    servers: Vec<(Arc<str>, Weak<AtomicU64>)>,
    last: Option<Arc<AtomicU64>>,
}

impl RetryThrottling {
    /// A count of `max_tokens` (above 0, at most 1,000, as A6 bounds it) that each success
    /// refills by `token_ratio` (above 0, read to three decimal places).
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] naming the field out of its range.
    pub fn new(max_tokens: f64, token_ratio: f64) -> Result<Self, InvalidConfig> {
        if !(max_tokens > 0.0 && max_tokens <= 1000.0) {
            return Err(InvalidConfig::new(
                AREA,
                format!("maxTokens ({max_tokens}) must be above 0 and at most 1000"),
            ));
        }
        // Three decimal places, to the nearest: below 0.0005 would be read as none, so it is
        // refused.
        let ratio = (token_ratio * 1000.0).round();
        if !(ratio >= 1.0 && token_ratio.is_finite()) {
            return Err(InvalidConfig::new(
                AREA,
                format!("tokenRatio ({token_ratio}) must be at least 0.001"),
            ));
        }
        let max = (max_tokens * 1000.0).round() as u64;
        Ok(RetryThrottling {
            max,
            ratio: ratio.min(1e12) as u64,
            tokens: Arc::new(AtomicU64::new(max)),
            channels: Arc::default(),
        })
    }

    /// The same throttling for one more channel to `server` (the layer's target): the count
    /// of a channel to the same server still in use, as gRPC's C core keeps one per server
    /// name; else (a server not named, or none of its channels alive) a count of its own, full,
    /// that [`tokens`](Self::tokens) reads among the others.
    pub(crate) fn for_server(&self, server: Option<&str>) -> RetryThrottling {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        // The counts of channels gone go with them.
        channels.alive.retain(|count| count.strong_count() > 0);
        channels
            .servers
            .retain(|(_, count)| count.strong_count() > 0);
        let named = server.and_then(|name| {
            let (_, count) = channels.servers.iter().find(|(n, _)| **n == *name)?;
            count.upgrade()
        });
        let tokens = named.unwrap_or_else(|| {
            let tokens = Arc::new(AtomicU64::new(self.max));
            channels.alive.push(Arc::downgrade(&tokens));
            if let Some(name) = server {
                channels
                    .servers
                    .push((Arc::from(name), Arc::downgrade(&tokens)));
            }
            tokens
        });
        channels.last = Some(tokens.clone());
        RetryThrottling {
            tokens,
            channels: self.channels.clone(),
            ..*self
        }
    }

    /// A count of its own for one more channel, its server not named.
    #[cfg(test)]
    fn for_channel(&self) -> RetryThrottling {
        self.for_server(None)
    }

    /// The count now, in tokens: the lowest of the channels' that layers made with this
    /// throttling and that are still in use (one, with a layer over one channel: the usual
    /// case); when none is, the last one's; before any is made, `max_tokens`.
    pub fn tokens(&self) -> f64 {
        let channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        let lowest = (channels.alive.iter())
            .filter_map(Weak::upgrade)
            .map(|count| count.load(Ordering::Relaxed))
            .min();
        let last = channels.last.as_ref().map(|c| c.load(Ordering::Relaxed));
        lowest.or(last).unwrap_or_else(|| self.milli()) as f64 / 1000.0
    }

    /// The most it holds.
    pub fn max_tokens(&self) -> f64 {
        self.max as f64 / 1000.0
    }

    /// What each success adds.
    pub fn token_ratio(&self) -> f64 {
        self.ratio as f64 / 1000.0
    }

    /// The count now, in thousandths.
    pub(crate) fn milli(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// A call ended with `code` under a policy that retries `retried`: `OK` refills, a retried
    /// code spends, any other counts nothing. Whether a retry may follow: only after a
    /// failure that left the count above half.
    pub(crate) fn ended(&self, code: u8, retried: CodeSet) -> bool {
        if code == super::OK {
            self.add(self.ratio);
            return false;
        }
        if !retried.has(code) {
            return false;
        }
        let before = self.take(1000);
        before.saturating_sub(1000) * 2 > self.max
    }

    /// Whether a hedge may go: the count is above half (A6: "subsequent hedged RPCs will only
    /// be sent if `token_count` is greater than the threshold").
    pub(crate) fn allows(&self) -> bool {
        self.milli() * 2 > self.max
    }

    fn add(&self, amount: u64) {
        let max = self.max;
        let _ = self
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_add(amount).min(max))
            });
    }

    /// Takes `amount` (down to 0); the count before.
    fn take(&self, amount: u64) -> u64 {
        match self
            .tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_sub(amount))
            }) {
            Ok(before) | Err(before) => before,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UNAVAILABLE: u8 = super::super::UNAVAILABLE;

    fn retried() -> CodeSet {
        CodeSet::of([14]).unwrap()
    }

    #[test]
    fn grpc_s_own_example_four_tokens_threshold_two() {
        // Max 4, ratio 1.6: the threshold is 2.
        let t = RetryThrottling::new(4.0, 1.6).unwrap();
        assert!(t.ended(UNAVAILABLE, retried()), "3 > 2");
        assert!(!t.ended(0, retried()));
        assert_eq!(t.milli(), 4000, "not above the most");
        assert!(t.ended(UNAVAILABLE, retried()), "3");
        assert!(!t.ended(UNAVAILABLE, retried()), "2 is at the threshold");
        assert!(t.milli() * 2 <= 4000, "no retry now");
        t.ended(0, retried());
        assert_eq!(t.milli(), 3600);
    }

    #[test]
    fn a_code_the_policy_does_not_retry_counts_nothing() {
        let t = RetryThrottling::new(2.0, 1.0).unwrap();
        assert!(!t.ended(3, retried()));
        assert_eq!(t.milli(), 2000);
    }

    #[test]
    fn clones_share_one_count() {
        let t = RetryThrottling::new(10.0, 0.5).unwrap();
        let u = t.clone();
        u.ended(UNAVAILABLE, retried());
        assert_eq!(t.tokens(), 9.0);
        assert_eq!(
            RetryThrottling::new(10.0, 0.5).unwrap().tokens(),
            10.0,
            "a new one is its own"
        );
        assert_eq!((t.max_tokens(), t.token_ratio()), (10.0, 0.5));
    }

    /// Issue 64, defect 8: each channel counts alone (A6 counts per server): a failure of one
    /// server's calls does not stop another's retries, though both channels were made from
    /// one throttling (a cloned config's). `tokens` reads the lowest count in use.
    #[test]
    fn each_channel_counts_alone_and_tokens_reads_the_lowest_in_use() {
        let t = RetryThrottling::new(4.0, 1.0).unwrap();
        let (a, b) = (t.for_channel(), t.clone().for_channel());
        assert!(a.ended(UNAVAILABLE, retried()), "4 → 3: retried");
        assert!(
            !a.ended(UNAVAILABLE, retried()),
            "3 → 2: at half, not retried"
        );
        assert!(!a.allows());
        // The other server's channel is full: its retries go.
        assert!(b.allows());
        assert!(b.ended(UNAVAILABLE, retried()));
        assert_eq!((a.milli(), b.milli()), (2000, 3000));
        assert_eq!(t.tokens(), 2.0, "the lowest in use");
        drop(a);
        assert_eq!(t.tokens(), 3.0, "the one left");
        drop(b);
        assert_eq!(t.tokens(), 3.0, "the last made, when none is in use");
    }

    /// Channels to one named server share its count, as gRPC's C core keeps one per server
    /// name; another server's, or a channel whose server is not named, count alone; a server
    /// whose channels are all gone starts again full.
    #[test]
    fn channels_to_one_named_server_share_its_count() {
        let t = RetryThrottling::new(4.0, 1.0).unwrap();
        let (a1, a2) = (
            t.for_server(Some("dns:///a")),
            t.clone().for_server(Some("dns:///a")),
        );
        let (b, unnamed) = (t.for_server(Some("dns:///b")), t.for_server(None));
        assert!(a1.ended(UNAVAILABLE, retried()), "4 → 3");
        assert!(!a2.ended(UNAVAILABLE, retried()), "3 → 2: the same count");
        assert!(!a1.allows() && !a2.allows());
        assert!(b.allows() && unnamed.allows());
        assert_eq!((b.milli(), unnamed.milli()), (4000, 4000));
        assert_eq!(
            t.for_server(None).milli(),
            4000,
            "an unnamed server's count is new"
        );
        drop((a1, a2));
        let again = t.for_server(Some("dns:///a"));
        assert_eq!(
            again.milli(),
            4000,
            "none of a's channels alive: a new count"
        );
        assert_eq!(
            t.channels.lock().unwrap().servers.len(),
            2,
            "a and b, those alive"
        );
    }

    /// The counts of channels gone are let go when another is made: the list holds those in
    /// use, however many channels come and go.
    #[test]
    fn the_counts_of_channels_gone_are_let_go() {
        let t = RetryThrottling::new(4.0, 1.0).unwrap();
        for _ in 0..100 {
            drop(t.for_channel());
        }
        let kept = t.for_channel();
        // The one in use, and the last one made before it (kept for `tokens` to read).
        let alive = t.channels.lock().unwrap().alive.len();
        assert_eq!(alive, 2);
        drop(kept);
    }

    #[test]
    fn out_of_range_fields_are_refused_by_name() {
        for (max, ratio, field) in [
            (0.0, 0.1, "maxTokens"),
            (1000.5, 0.1, "maxTokens"),
            (f64::NAN, 0.1, "maxTokens"),
            (10.0, 0.0, "tokenRatio"),
            (10.0, 0.0004, "tokenRatio"),
            (10.0, f64::INFINITY, "tokenRatio"),
        ] {
            let err = RetryThrottling::new(max, ratio).unwrap_err();
            assert!(err.to_string().contains(field), "{max} {ratio}: {err}");
        }
        assert!(RetryThrottling::new(1000.0, 0.001).is_ok());
    }

    proptest! {
        /// Against A6's text, in real numbers: a failure takes 1 (not below 0), a success adds
        /// the ratio (not above the most), and a retry is allowed exactly when the count is
        /// above half of the most.
        #[test]
        fn the_count_follows_a6_s_arithmetic(
            max in 1u32..=1000,
            ratio_milli in 1u32..5000,
            script in proptest::collection::vec(0u8..3, 0..200),
        ) {
            let t = RetryThrottling::new(f64::from(max), f64::from(ratio_milli) / 1000.0).unwrap();
            let mut model = i64::from(max) * 1000;
            for step in script {
                let code = [0, UNAVAILABLE, 5][usize::from(step)];
                let allowed = t.ended(code, retried());
                match code {
                    0 => {
                        model = (model + i64::from(ratio_milli)).min(i64::from(max) * 1000);
                        prop_assert!(!allowed);
                    }
                    UNAVAILABLE => {
                        model = (model - 1000).max(0);
                        prop_assert_eq!(allowed, model * 2 > i64::from(max) * 1000);
                    }
                    _ => prop_assert!(!allowed),
                }
                prop_assert_eq!(t.milli() as i64, model);
            }
        }
    }
}
