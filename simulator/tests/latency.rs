//! The latency-aware attempts hold the bounds the documentation states: hedged reads cut the
//! tail at least tenfold for at most `m` of extra load (plus a small burst) and leave the median
//! alone; a timeout from latency cuts the tail of dead connections at least tenfold and cuts at
//! most 1 % of a brownout's attempts that would have answered.

use std::time::Duration;

use reqwest_safe_retry_simulator::{DeadConnections, RATE_PER_SEC, TailAtScale};

/// The documentation's settings in a release build; in a debug one (the test command) a third
/// of the tail's traffic, and a quarter of the brownout's, with the same distributions.
fn release() -> bool {
    !cfg!(debug_assertions)
}

#[test]
fn hedged_reads_cut_the_p99_9_tenfold_for_at_most_five_percent_more_load() {
    let duration = Duration::from_secs(if release() { 60 } else { 20 });
    let run = |hedge| {
        TailAtScale {
            rate_per_sec: RATE_PER_SEC,
            duration,
            hedge,
            seed: 2015,
        }
        .run()
    };
    let (without, with) = (run(false), run(true));
    let requests = without.latencies.len() as f64;
    println!(
        "p50 {:?} -> {:?}, p99.9 {:?} -> {:?}, hedges {}, extra load {:.4}",
        without.percentile(0.5),
        with.percentile(0.5),
        without.percentile(0.999),
        with.percentile(0.999),
        with.hedges,
        with.extra_load()
    );
    assert!(
        with.percentile(0.999) * 10 <= without.percentile(0.999),
        "p99.9 {:?} with hedging, {:?} without",
        with.percentile(0.999),
        without.percentile(0.999)
    );
    // At most m = 5 % of the requests, plus a burst of 10 (the budget's first tokens).
    assert!(
        with.extra_load() <= 0.05 + 10.0 / requests,
        "extra load {}",
        with.extra_load()
    );
    assert!(with.hedges > 0);
    let (p50, hedged_p50) = (without.percentile(0.5), with.percentile(0.5));
    assert!(
        hedged_p50.abs_diff(p50) * 20 <= p50,
        "p50 {hedged_p50:?} with hedging, {p50:?} without"
    );
}

#[test]
fn a_timeout_from_latency_cuts_dead_connections_tenfold_and_lets_a_brownout_through() {
    let rate = if release() { RATE_PER_SEC } else { 50 };
    let run = |from_latency| {
        DeadConnections {
            rate_per_sec: rate,
            duration: Duration::from_secs(60),
            from_latency,
            seed: 2015,
        }
        .run()
    };
    let (fixed, measured) = (run(false), run(true));
    println!(
        "p99.9 {:?} -> {:?}; brownout attempts cut that would have answered: {} of {}",
        fixed.percentile(0.999),
        measured.percentile(0.999),
        measured.brownout_cut,
        measured.brownout_attempts
    );
    assert!(
        measured.percentile(0.999) * 10 <= fixed.percentile(0.999),
        "p99.9 {:?} from latency, {:?} fixed",
        measured.percentile(0.999),
        fixed.percentile(0.999)
    );
    assert!(measured.brownout_attempts >= u64::from(rate) * 29);
    assert!(
        measured.brownout_cut_share() <= 0.01,
        "{} of {} cut",
        measured.brownout_cut,
        measured.brownout_attempts
    );
    // The fixed timeout cuts none of them: the comparison is with what it lets through.
    assert_eq!(fixed.brownout_cut, 0);
}
