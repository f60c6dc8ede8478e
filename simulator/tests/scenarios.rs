//! The simulator's scenarios hold the orderings the documentation draws from them.

use std::time::Duration;

use reqwest_safe_retry::{RetryBudget, RetryPolicy};
use reqwest_safe_retry_simulator::{
    Contention, Herd, Jitter, Layers, OpenLoop, Scale, Service, figures_at,
};

fn contention(jitter: Jitter) -> reqwest_safe_retry_simulator::ContentionReport {
    Contention {
        clients: 100,
        write_time: Duration::from_millis(10),
        base: Duration::from_millis(10),
        cap: Duration::from_secs(10),
        jitter,
        seed: 2015,
    }
    .run()
}

#[test]
fn with_100_clients_full_jitter_halves_the_calls_and_no_jitter_takes_far_longer() {
    let none = contention(Jitter::None);
    let full = contention(Jitter::Full);
    println!("no jitter: {none:?}; full jitter: {full:?}");
    assert!(
        full.calls * 2 <= none.calls,
        "{} vs {}",
        full.calls,
        none.calls
    );
    assert!(
        none.completion >= full.completion * 3,
        "{:?} vs {:?}",
        none.completion,
        full.completion
    );
}

#[test]
fn during_an_outage_the_budget_keeps_the_load_within_a_tenth_of_the_offered_load() {
    let (start, end) = (20, 60);
    let report = OpenLoop {
        rate_per_sec: 100,
        duration: Duration::from_secs(90),
        service: Service::OutageBetween {
            start: Duration::from_secs(start),
            end: Duration::from_secs(end),
        },
        policy: RetryPolicy::default(),
        budget: Some(RetryBudget::default()),
        seed: 2015,
    }
    .run();
    let outage = &report.attempts_per_second[start as usize..end as usize];
    let peak = outage.iter().copied().max().unwrap();
    println!("attempts per second during the outage: {outage:?}");
    assert!(peak <= 110, "peak {peak} attempts/s against 100 offered");
}

#[test]
fn one_layer_retries_however_many_are_stacked() {
    for depth in 1..=4 {
        let run = |single_layer_rule| {
            Layers {
                depth,
                attempts_per_layer: 3,
                single_layer_rule,
                requests: 5,
            }
            .run()
            .backend_attempts_per_request
        };
        assert!(run(true) <= 3.0, "{depth} layers");
        assert_eq!(
            run(false),
            3f64.powi(depth as i32),
            "{depth} layers without the rule"
        );
    }
}

#[test]
fn jitter_above_the_floor_breaks_up_the_herd() {
    let run = |jitter_above_floor| {
        Herd {
            clients: 500,
            retry_after_secs: 2,
            jitter_above_floor,
            seed: 2015,
        }
        .run()
    };
    let (with, without) = (run(true), run(false));
    // Without: every retry in the one 10 ms bucket at exactly 2 s.
    assert_eq!(without.peak_retries_per_10ms(), 500);
    assert_eq!(without.arrivals_per_10ms[200], 500);
    // With: spread over the first retry's 100 ms window above the floor, none before it.
    assert!(
        with.peak_retries_per_10ms() <= 100,
        "{:?}",
        with.arrivals_per_10ms
    );
    assert!(with.arrivals_per_10ms[1..200].iter().all(|n| *n == 0));
    assert_eq!(with.arrivals_per_10ms.iter().sum::<u64>(), 1000);
}

#[test]
fn the_same_seed_gives_byte_identical_figures() {
    // The full figures take seconds in a release build and a minute in a debug one.
    let scale = if cfg!(debug_assertions) {
        Scale::Small
    } else {
        Scale::Full
    };
    let draw = || -> Vec<String> {
        figures_at(7, scale)
            .iter()
            .map(|f| f.chart.to_svg() + &f.table)
            .collect()
    };
    let (first, second) = (draw(), draw());
    assert_eq!(first.len(), 8);
    assert_eq!(first, second);
    for svg in &first {
        assert!(svg.contains("</svg>"));
    }
}

/// The metastable failure: without a budget the dependency never comes back; with the budget
/// and the throttle it comes back within 5 s of the trigger's end.
#[test]
fn retries_without_a_budget_keep_an_overload_going_and_the_throttle_ends_it() {
    use reqwest_safe_retry_simulator::{Clients, Metastable};
    // A tenth of the traffic in a debug build: the same queue, timeouts and trigger.
    let capacity = if cfg!(debug_assertions) { 10 } else { 100 };
    let run = |clients| Metastable::at_capacity(capacity, clients, 2015).run();
    let without = run(Clients::RetriesWithoutBudget);
    assert_eq!(without.recovery, None, "{:?}", without.goodput_per_second);
    // Still down at 60 s after the trigger: nothing but timed-out work gets done.
    assert!(without.goodput_per_second[30..90].iter().all(|g| *g == 0));
    let throttled = run(Clients::BudgetAndThrottle);
    let recovery = throttled.recovery.expect("recovers");
    assert!(
        recovery <= 5,
        "{recovery} s: {:?}",
        throttled.goodput_per_second
    );
    let budget = run(Clients::RetriesWithBudget);
    let no_retries = run(Clients::NoRetries);
    println!(
        "recovery: no retries {:?}, budget {:?}, budget and throttle {recovery}",
        no_retries.recovery, budget.recovery
    );
    assert!(budget.recovery.is_some() && no_retries.recovery.is_some());
}
