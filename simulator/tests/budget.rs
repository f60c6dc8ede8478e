//! The retry budget on whole traffic, in virtual time: bounded amplification in an outage, no
//! cost when healthy, and the load during an outage.

use std::time::Duration;

use reqwest_safe_retry::{RetryBudget, RetryPolicy};
use reqwest_safe_retry_simulator::{OpenLoop, Report, Service};

/// The request rates tried: 1,000 a second too in a release build, where a minute of it takes
/// a moment (in a debug build, seconds).
const RATES: &[u32] = if cfg!(debug_assertions) {
    &[100]
} else {
    &[100, 1_000]
};

/// How long the traffic runs: 20 s in a debug build, a minute in release. The outage test
/// below, whose outage ends at 40 s, runs for a minute in both.
const SECS: u64 = if cfg!(debug_assertions) { 20 } else { 60 };

fn simulate(rate: u32, service: Service, budget: Option<RetryBudget>) -> Report {
    simulate_for(SECS, rate, service, budget)
}

fn simulate_for(secs: u64, rate: u32, service: Service, budget: Option<RetryBudget>) -> Report {
    OpenLoop {
        rate_per_sec: rate,
        duration: Duration::from_secs(secs),
        service,
        policy: RetryPolicy::builder().max_attempts(3).build().unwrap(),
        budget,
        seed: 2026,
    }
    .run()
}

#[test]
fn a_total_outage_costs_at_most_ten_percent_extra_load_with_the_default_budget() {
    for &rate in RATES {
        let budgeted = simulate(rate, Service::Outage, Some(RetryBudget::default()));
        let unbudgeted = simulate(rate, Service::Outage, None);
        println!(
            "{rate}/s outage: {:.3} attempts per request with the default budget, {:.3} without",
            budgeted.attempts_per_request(),
            unbudgeted.attempts_per_request()
        );
        assert_eq!(budgeted.logical_requests, u64::from(rate) * SECS);
        assert!(budgeted.attempts_per_request() <= 1.10, "{budgeted:?}");
        assert_eq!(unbudgeted.attempts_per_request(), 3.0);
    }
}

#[test]
fn a_healthy_service_loses_nothing_to_the_budget() {
    for &rate in RATES {
        let healthy = Service::Healthy { failure_rate: 0.05 };
        let budgeted = simulate(rate, healthy, Some(RetryBudget::default()));
        let unbudgeted = simulate(rate, healthy, None);
        let gap = (budgeted.success_rate() - unbudgeted.success_rate()).abs() * 100.0;
        println!(
            "{rate}/s with 5 % failures: {:.4} % succeed with the default budget, {:.4} % without",
            budgeted.success_rate() * 100.0,
            unbudgeted.success_rate() * 100.0
        );
        assert!(gap <= 0.1, "{gap} percentage points");
        assert_eq!(budgeted.budget_refusals, 0);
    }
}

#[test]
fn the_same_seed_gives_the_same_report() {
    let run = || {
        simulate(
            100,
            Service::Healthy { failure_rate: 0.2 },
            Some(RetryBudget::default()),
        )
    };
    assert_eq!(run(), run());
}

#[test]
fn during_an_outage_the_load_falls_to_the_offered_load_plus_the_floor() {
    let report = simulate_for(
        60,
        100,
        Service::OutageBetween {
            start: Duration::from_secs(10),
            end: Duration::from_secs(40),
        },
        Some(RetryBudget::default()),
    );
    let per_second = &report.attempts_per_second;
    // Once the burst the bucket held is spent, each second of outage sees the 100 offered
    // attempts and at most the floor's one retry a second (plus one second's rounding).
    for (second, &attempts) in per_second.iter().enumerate().take(40).skip(12) {
        assert!(attempts <= 102, "second {second}: {attempts}");
    }
}
