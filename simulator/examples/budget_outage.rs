//! What a retry budget does to an outage, in one table.
//!
//! Open-loop traffic (requests keep arriving at a fixed rate) meets a dependency for 60 s of
//! virtual time: first a total outage, then a healthy service where 5 % of attempts fail at
//! random. Each row is one (service, offered rate, budget); the columns say how many attempts
//! each logical request cost the dependency, and how many logical requests succeeded.
//!
//! Run it with `cargo run --release -p reqwest-safe-retry-simulator --example budget_outage`.

use std::time::Duration;

use reqwest_safe_retry::{RetryBudget, RetryPolicy};
use reqwest_safe_retry_simulator::{OpenLoop, Service};

fn main() {
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .build()
        .expect("a valid policy");
    type MakeBudget = fn() -> Option<RetryBudget>;
    let budgets: [(&str, MakeBudget); 3] = [
        ("no budget", || None),
        ("ratio 10 % (default)", || Some(RetryBudget::default())),
        ("AWS-like bucket", || Some(RetryBudget::aws_like())),
    ];
    let services = [
        ("total outage", Service::Outage),
        ("5 % failures", Service::Healthy { failure_rate: 0.05 }),
    ];

    println!("max attempts 3, 60 s of virtual time per row\n");
    println!(
        "{:<14} {:>9}  {:<22} {:>20} {:>13} {:>16}",
        "service", "rate/s", "budget", "attempts per request", "success rate", "budget refusals"
    );
    for (service_name, service) in services {
        for rate in [100, 1_000] {
            for (budget_name, budget) in budgets {
                let report = OpenLoop {
                    rate_per_sec: rate,
                    duration: Duration::from_secs(60),
                    service,
                    policy,
                    budget: budget(),
                    seed: 2026,
                }
                .run();
                println!(
                    "{:<14} {:>9}  {:<22} {:>20.3} {:>12.3} % {:>16}",
                    service_name,
                    rate,
                    budget_name,
                    report.attempts_per_request(),
                    report.success_rate() * 100.0,
                    report.budget_refusals,
                );
            }
        }
    }
}
