//! What a dependency's attempts take: a sliding window of their latencies, and the attempt
//! timeout and hedging delay read from it.
//!
//! # Why measured, and why these samples
//!
//! A fixed attempt timeout is a guess. Against a dependency that answers in 20 ms, 10 s holds a
//! caller for 10 s on a dead connection before the retry that would have answered at once; set
//! low instead, a brownout turns every slow answer into a timeout and a retry. So a dependency
//! that opts in gets its timeout from what its attempts take: `k x p99.9` of the recent answers,
//! never below a floor, never above the policy's fixed timeout, which also serves until the
//! window holds [`MIN_SAMPLES`] answers.
//!
//! The window holds the latencies of *answers* (any status: a quick 503 would drag the
//! percentile down, so answers with a status the policy retries are left out). A timeout is not
//! a latency: it says only "longer than the limit". Recorded at its limit, as some systems do,
//! it makes the percentile the limit itself as soon as more than 0.1 % of attempts never answer
//! (dead connections), and the timeout then doubles at each refresh until it reaches its cap:
//! the measured timeout would be lost exactly where it helps most. So a timeout is counted
//! apart. It brings the next refresh forward (a brownout is seen at once, through the answers
//! that a retry's longer timeout lets through), and when more than [`MAX_TIMEOUT_SHARE`] of the
//! window's attempts timed out the window is not believed and the fixed timeout serves again
//! until answers refill it: a dependency whose answers all outlast the measured timeout is
//! never starved of answers.
//!
//! # How
//!
//! [`SLICES`] slices of [`SLICE`] each (30 s in all), each a log-linear histogram of
//! microseconds with [`SUB_BUCKETS`] buckets per power of two (a bucket's width is at most an
//! eighth of its value), counted in 32 bits (11 KB in all): recording an answer is a load of
//! its slice's epoch and one relaxed atomic addition, from any number of requests at once, with
//! no lock. A slice is emptied when time comes back round to it; a sample recorded at that
//! instant by another thread may be lost, which a window of thousands of samples does not
//! notice. The percentiles are read at most once a [`REFRESH`] (or after a timeout) by
//! whichever request finds them due, and what the policy makes of them (the timeout and the
//! hedging delay) is kept in one atomic: a request reads two (that one, and when the next
//! reading is due).
//!
//! # Cutting at the measured limit
//!
//! A measured limit is a guess that an attempt outlasting nearly every answer is a straggler.
//! When every answer slows at once (a brownout) the guess is wrong for every attempt in
//! flight, and cutting them all would turn each into a retry the budget must pay for, against
//! the same slowness. So an attempt is cut at its measured limit only while the cuts this
//! second are within an allowance ([`MIN_CUTS`], or [`CUT_SHARE`] of the answer rate if more);
//! past it, the attempt runs on to the fixed timeout. Asked only when a limit is reached: the
//! success path pays nothing for it.
//!
//! A percentile is reported as the upper edge of its bucket, so it is never below the true one
//! and at most an eighth above it.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::Instant;

use crate::engine::policy::RetryPolicy;

/// Slices in the window.
pub(crate) const SLICES: usize = 10;
/// How long one slice counts: the window is `SLICES * SLICE` (30 s).
pub(crate) const SLICE: Duration = Duration::from_secs(3);
/// The percentiles are read again at most this often, unless a timeout asks for it sooner.
pub(crate) const REFRESH: Duration = Duration::from_secs(1);
/// The answers the window must hold before its percentiles are used.
pub(crate) const MIN_SAMPLES: u64 = 100;
/// The share of the window's attempts that may time out before the window is not believed.
pub(crate) const MAX_TIMEOUT_SHARE: f64 = 0.05;
/// The fewest attempts a second that may be cut at a measured limit below the fixed timeout;
/// more when the dependency answers more than [`MIN_CUTS`] / [`CUT_SHARE`] a second.
pub(crate) const MIN_CUTS: u32 = 2;
/// The share of the window's answer rate that may be cut at a measured limit each second.
pub(crate) const CUT_SHARE: f64 = 0.01;
/// Buckets per power of two: 2^3.
const SUB_BITS: u32 = 3;
pub(crate) const SUB_BUCKETS: usize = 1 << SUB_BITS;
/// Microseconds up to 2^36 (about 19 hours) are told apart; longer ones share the last bucket.
const TOP_BIT: u32 = 36;
const BUCKETS: usize = ((TOP_BIT - SUB_BITS + 1) as usize + 1) * SUB_BUCKETS;
/// No slice held yet.
const EMPTY: u64 = u64::MAX;

/// The bucket of a latency of `micros`.
fn bucket(micros: u64) -> usize {
    let micros = micros.min((1 << (TOP_BIT + 1)) - 1);
    if micros < SUB_BUCKETS as u64 {
        return micros as usize;
    }
    let top = 63 - micros.leading_zeros();
    let shift = top - SUB_BITS;
    let sub = (micros >> shift) as usize & (SUB_BUCKETS - 1);
    (shift as usize + 1) * SUB_BUCKETS + sub
}

/// The smallest latency, in microseconds, above every latency in bucket `index`.
fn upper_edge(index: usize) -> u64 {
    let (octave, sub) = (index / SUB_BUCKETS, (index % SUB_BUCKETS) as u64);
    if octave == 0 {
        return sub + 1;
    }
    let shift = octave as u32 - 1;
    (SUB_BUCKETS as u64 + sub + 1) << shift
}

/// One slice of the window.
#[derive(Debug)]
struct Slice {
    /// Which slice of time (its number since the window's origin) it holds; `EMPTY` at first.
    epoch: AtomicU64,
    /// Answers per bucket; 32 bits hold any count one slice sees (over a million a second).
    counts: Box<[AtomicU32]>,
    timeouts: AtomicU64,
}

impl Slice {
    fn new() -> Slice {
        Slice {
            epoch: AtomicU64::new(EMPTY),
            counts: (0..BUCKETS).map(|_| AtomicU32::new(0)).collect(),
            timeouts: AtomicU64::new(0),
        }
    }

    /// The slice, emptied first if it held an older slice of time than `epoch`.
    fn at(&self, epoch: u64) -> &Slice {
        let held = self.epoch.load(Ordering::Acquire);
        if held != epoch
            && self
                .epoch
                .compare_exchange(held, epoch, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            for count in &*self.counts {
                count.store(0, Ordering::Relaxed);
            }
            self.timeouts.store(0, Ordering::Relaxed);
        }
        self
    }
}

/// The window's percentiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Percentiles {
    /// The attempt timeout's percentile (p99.9), if the window is believed.
    pub(crate) slow: Option<Duration>,
    /// The hedging percentile (`p(1 - m)`), if the window is believed.
    pub(crate) hedge: Option<Duration>,
}

/// What the policy makes of the percentiles, as the window keeps it between readings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Measured {
    /// The attempt timeout from latency, if the policy takes it and the window is believed.
    pub(crate) timeout: Option<Duration>,
    /// The hedging delay, if the policy hedges and the window is believed.
    pub(crate) hedge_after: Option<Duration>,
}

/// The latency window of one dependency, shared by its clones.
#[derive(Debug)]
pub(crate) struct LatencyWindow {
    /// The dependency's policy, which turns percentiles into a timeout and a hedging delay.
    policy: RetryPolicy,
    /// The hedging percentile's rank, `1 - m`.
    hedge_rank: f64,
    origin: OnceLock<Instant>,
    slices: Box<[Slice]>,
    /// What the policy made of the percentiles last read: the timeout in the low half and the
    /// hedging delay in the high half, each in microseconds plus one (0: none); one atomic, so
    /// a request reads both at once.
    measured: AtomicU64,
    /// When (microseconds since the origin) the percentiles are next due; 0 after a timeout,
    /// which asks for them at once.
    due: AtomicU64,
    /// The attempts that may be cut at a measured limit each second, as last read.
    cut_allowance: AtomicU32,
    /// The second (of the window's time) of the last cut in the high half, the cuts made in it
    /// in the low half.
    cuts: AtomicU64,
}

impl LatencyWindow {
    /// The window of a dependency with `policy`.
    pub(crate) fn new(policy: &RetryPolicy) -> LatencyWindow {
        let extra_load = policy.hedge_reads().map_or(0.05, |(load, _)| load);
        LatencyWindow {
            policy: *policy,
            hedge_rank: 1.0 - extra_load,
            origin: OnceLock::new(),
            slices: (0..SLICES).map(|_| Slice::new()).collect(),
            measured: AtomicU64::new(0),
            due: AtomicU64::new(0),
            cut_allowance: AtomicU32::new(MIN_CUTS),
            cuts: AtomicU64::new(0),
        }
    }

    /// Whether an attempt that reached its measured limit at `now` may be cut there: while few
    /// are (at most the allowance this second), an attempt that outlasts nearly every answer
    /// is a straggler, and a retry answers sooner. Past it, the attempts reaching their limits
    /// together say that the dependency slowed for everyone (a brownout): cutting them would
    /// only turn each into a retry, so they run on to the fixed timeout. Asked only when a
    /// limit is reached.
    pub(crate) fn take_cut(&self, now: Instant) -> bool {
        let second = self.micros(now) / 1_000_000;
        let allowance = self.cut_allowance.load(Ordering::Relaxed);
        self.cuts
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |packed| {
                let (epoch, taken) = (packed >> 32, packed & u64::from(u32::MAX));
                if epoch != second {
                    Some(second << 32 | 1)
                } else if taken < u64::from(allowance) {
                    Some(packed + 1)
                } else {
                    None
                }
            })
            .is_ok()
    }

    /// `now` as the window's time: microseconds from its origin (its first use).
    pub(crate) fn micros(&self, now: Instant) -> u64 {
        let origin = *self.origin.get_or_init(|| now);
        u64::try_from(now.saturating_duration_since(origin).as_micros()).unwrap_or(u64::MAX)
    }

    fn slice(&self, at: u64) -> &Slice {
        let epoch = at / SLICE.as_micros() as u64;
        self.slices[(epoch % SLICES as u64) as usize].at(epoch)
    }

    /// Counts an answer that took `took`, at `now`.
    #[cfg(test)]
    pub(crate) fn answered(&self, took: Duration, now: Instant) {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let at = self.micros(now);
        self.count_answer(micros, at);
    }

    /// Counts an answer at `now` to an attempt sent at `sent` (the window's time, as
    /// [`measured`](Self::measured) gave it): one reading of the time for both. An answer that
    /// took no time on the clock is not counted: no real attempt answers within a microsecond,
    /// and a clock that did not move (tokio's paused clock while a real server answers, a
    /// `FakeClock` a test did not advance) says nothing of latency; counted, its zeros would
    /// set the timeout at its floor and hedge every read at once.
    pub(crate) fn answered_since(&self, sent: u64, now: Instant) {
        let at = self.micros(now);
        let took = at.saturating_sub(sent);
        if took > 0 {
            self.count_answer(took, at);
        }
    }

    fn count_answer(&self, micros: u64, at: u64) {
        self.slice(at).counts[bucket(micros)].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an attempt that timed out, at `now`: the percentiles are read again at the next
    /// question.
    pub(crate) fn timed_out(&self, now: Instant) {
        let at = self.micros(now);
        self.slice(at).timeouts.fetch_add(1, Ordering::Relaxed);
        self.due.store(0, Ordering::Relaxed);
    }

    /// What the policy makes of the percentiles at `now` (as last read, or read again when
    /// due), and `now` as the window's time, for [`answered_since`](Self::answered_since).
    pub(crate) fn measured(&self, now: Instant) -> (Measured, u64) {
        let at = self.micros(now);
        let due = self.due.load(Ordering::Relaxed);
        if at >= due
            && self
                .due
                .compare_exchange(
                    due,
                    at.saturating_add(REFRESH.as_micros() as u64).max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            let read = self.read(at);
            let measured = Measured {
                timeout: read.slow.and_then(|slow| self.policy.timeout_for(slow)),
                hedge_after: self.policy.hedge_delay(read.hedge),
            };
            let packed = encode(measured.timeout) | encode(measured.hedge_after) << 32;
            self.measured.store(packed, Ordering::Relaxed);
            return (measured, at);
        }
        let packed = self.measured.load(Ordering::Relaxed);
        let measured = Measured {
            timeout: decode(packed & u64::from(u32::MAX)),
            hedge_after: decode(packed >> 32),
        };
        (measured, at)
    }

    /// Reads the percentiles from the slices still in the window at `at`.
    fn read(&self, at: u64) -> Percentiles {
        let newest = at / SLICE.as_micros() as u64;
        let live = |slice: &&Slice| {
            let epoch = slice.epoch.load(Ordering::Acquire);
            epoch != EMPTY && epoch <= newest && newest - epoch < SLICES as u64
        };
        // On the stack: a heap block this size, made and freed once a second, costs glibc a
        // consolidation of its free lists each time.
        let mut counts = [0u64; BUCKETS];
        let mut timeouts = 0u64;
        for slice in self.slices.iter().filter(live) {
            for (sum, count) in counts.iter_mut().zip(&*slice.counts) {
                *sum += u64::from(count.load(Ordering::Relaxed));
            }
            timeouts += slice.timeouts.load(Ordering::Relaxed);
        }
        let answers: u64 = counts.iter().sum();
        // The answer rate over the window, of which a share may be cut each second.
        let per_second = answers as f64 / (SLICES as f64 * SLICE.as_secs_f64());
        let allowance = (per_second * CUT_SHARE) as u32;
        self.cut_allowance
            .store(allowance.max(MIN_CUTS), Ordering::Relaxed);
        let believed = answers >= MIN_SAMPLES
            && (timeouts as f64) <= MAX_TIMEOUT_SHARE * (answers + timeouts) as f64;
        if !believed {
            return Percentiles {
                slow: None,
                hedge: None,
            };
        }
        Percentiles {
            slow: Some(quantile(&counts, answers, 0.999)),
            hedge: Some(quantile(&counts, answers, self.hedge_rank)),
        }
    }
}

/// The `q` quantile of `answers` samples in `counts`: the upper edge of the bucket that holds
/// the sample of rank `ceil(q * answers)`.
fn quantile(counts: &[u64], answers: u64, q: f64) -> Duration {
    let rank = ((q * answers as f64).ceil() as u64).clamp(1, answers);
    let mut seen = 0;
    let index = counts
        .iter()
        .position(|count| {
            seen += count;
            seen >= rank
        })
        .unwrap_or_else(|| unreachable!("the rank is at most the answers counted"));
    Duration::from_micros(upper_edge(index))
}

/// A duration in microseconds plus one, in 32 bits (0: none); longer than 71 minutes reads
/// as 71 minutes.
fn encode(value: Option<Duration>) -> u64 {
    value.map_or(0, |d| {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        micros.min(u64::from(u32::MAX - 1)) + 1
    })
}

fn decode(value: u64) -> Option<Duration> {
    value.checked_sub(1).map(Duration::from_micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A window whose hedging percentile is `p(1 - m)`, with a policy that takes its timeout
    /// as the p99.9 itself (x1, floor 1 us, under an hour) and hedges at the percentile.
    fn window(m: f64) -> LatencyWindow {
        let hour = Duration::from_secs(3_600);
        let policy = RetryPolicy::builder()
            .attempt_timeout(hour)
            .deadline(hour)
            .timeout_from_latency(1.0, Duration::from_micros(1))
            .hedge_reads(m, hour)
            .build()
            .unwrap();
        LatencyWindow::new(&policy)
    }

    #[test]
    fn buckets_are_contiguous_and_each_at_most_an_eighth_wide() {
        let mut last = 0;
        for micros in (0..100_000u64).chain([1 << 20, (1 << 36) - 1, 1 << 36, u64::MAX]) {
            let index = bucket(micros);
            assert!(index < BUCKETS, "{micros}");
            assert!(index >= last || micros >= 1 << 20, "{micros}");
            last = index;
            let upper = upper_edge(index);
            if micros < 1 << (TOP_BIT + 1) {
                assert!(upper > micros, "{micros}: {upper}");
                assert!(upper - micros <= micros / 8 + 1, "{micros}: {upper}");
            }
        }
        for index in 0..BUCKETS - 1 {
            // The next bucket starts where this one ends.
            assert_eq!(bucket(upper_edge(index)), index + 1, "{index}");
            assert_eq!(bucket(upper_edge(index) - 1), index, "{index}");
        }
    }

    #[test]
    fn a_kept_value_saturates_at_71_minutes_within_its_own_half() {
        let top = Duration::from_micros(u64::from(u32::MAX - 1));
        for long in [top, Duration::from_secs(3 * 3_600), Duration::MAX] {
            let packed = encode(Some(long)) | encode(Some(ms(5))) << 32;
            assert_eq!(decode(packed & u64::from(u32::MAX)), Some(top), "{long:?}");
            assert_eq!(decode(packed >> 32), Some(ms(5)), "{long:?}");
        }
        assert_eq!(encode(None), 0);
        assert_eq!(decode(encode(Some(Duration::ZERO))), Some(Duration::ZERO));
    }

    #[test]
    fn an_empty_or_thin_window_is_not_believed() {
        let window = window(0.05);
        let start = Instant::now();
        assert_eq!(window.measured(start).0.timeout, None);
        for _ in 0..MIN_SAMPLES - 1 {
            window.answered(ms(20), start);
        }
        assert_eq!(window.read(0).slow, None);
        window.answered(ms(20), start);
        let read = window.read(0);
        assert!(read.slow.is_some() && read.hedge.is_some());
    }

    #[test]
    fn a_window_of_20_ms_answers_reads_20_ms_within_an_eighth() {
        let window = window(0.05);
        let start = Instant::now();
        for _ in 0..1_000 {
            window.answered(ms(20), start);
        }
        let read = window.read(0);
        let slow = read.slow.unwrap();
        assert!(slow > ms(20) && slow <= ms(20) + ms(20) / 8, "{slow:?}");
        assert_eq!(read.hedge, read.slow);
    }

    #[test]
    fn percentiles_are_kept_until_due_and_read_again_after_a_timeout() {
        let window = window(0.05);
        let start = Instant::now();
        assert_eq!(window.measured(start).0.timeout, None);
        for _ in 0..200 {
            window.answered(ms(10), start);
        }
        // Not due yet: what was read stands.
        assert_eq!(window.measured(start + ms(999)).0.timeout, None);
        let due = window.measured(start + REFRESH).0.timeout.unwrap();
        assert!(due > ms(10) && due <= ms(12), "{due:?}");
        // Slower answers, and a timeout that brings the reading forward.
        for _ in 0..10 {
            window.answered(ms(80), start + REFRESH);
        }
        assert_eq!(window.measured(start + REFRESH).0.timeout, Some(due));
        window.timed_out(start + REFRESH);
        let read = window.measured(start + REFRESH).0.timeout.unwrap();
        assert!(read > ms(80) && read <= ms(90), "{read:?}");
    }

    #[test]
    fn a_window_whose_attempts_mostly_time_out_is_not_believed() {
        let window = window(0.05);
        let start = Instant::now();
        for _ in 0..1_000 {
            window.answered(ms(5), start);
        }
        // 5 % of the attempts: still believed.
        for _ in 0..52 {
            window.timed_out(start);
        }
        assert!(window.read(0).slow.is_some());
        window.timed_out(start);
        assert_eq!(window.read(0).slow, None);
    }

    #[test]
    fn slices_leave_the_window_after_30_s() {
        let window = window(0.05);
        let start = Instant::now();
        for _ in 0..200 {
            window.answered(ms(500), start);
        }
        for _ in 0..200 {
            window.answered(ms(5), start + SLICE * 9);
        }
        let at = |d: Duration| window.micros(start + d);
        // Both in the window: the slow half sets p99.9.
        assert!(window.read(at(SLICE * 9)).slow.unwrap() >= ms(500));
        // The first slice has left it.
        let later = window.read(at(SLICE * 10)).slow.unwrap();
        assert!(later <= ms(6), "{later:?}");
        // A slice reused for a later time is emptied first.
        window.answered(ms(5), start + SLICE * 10);
        let reused = &window.slices[0];
        assert_eq!(reused.epoch.load(Ordering::Relaxed), 10);
        let held: u64 = reused
            .counts
            .iter()
            .map(|c| u64::from(c.load(Ordering::Relaxed)))
            .sum();
        assert_eq!(held, 1);
        // A whole window of silence: nothing left.
        assert_eq!(window.read(at(SLICE * 30)).slow, None);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// The exact `q` quantile of `samples` (rank `ceil(q * n)`), in microseconds.
        fn exact(samples: &mut [u64], q: f64) -> u64 {
            samples.sort_unstable();
            let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
            samples[rank - 1]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 64 } else { 2_000 }))]

            /// Against the exact quantiles of any samples: never below, at most an eighth above.
            #[test]
            fn percentiles_bound_the_exact_ones(
                mut samples in proptest::collection::vec(
                    prop_oneof![0u64..100, 100u64..100_000, 100_000u64..60_000_000],
                    MIN_SAMPLES as usize..2_000,
                ),
                m in 0.01f64..0.5,
            ) {
                let window = window(m);
                let start = Instant::now();
                for s in &samples {
                    window.answered(Duration::from_micros(*s), start);
                }
                let read = window.read(0);
                for (got, q) in [(read.slow.unwrap(), 0.999), (read.hedge.unwrap(), 1.0 - m)] {
                    let exact = exact(&mut samples, q);
                    let got = got.as_micros() as u64;
                    prop_assert!(got > exact, "q {}: {} <= {}", q, got, exact);
                    prop_assert!(got <= exact + exact / 8 + 1, "q {}: {} vs {}", q, got, exact);
                }
            }
        }
    }
}
