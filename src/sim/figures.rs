//! The standard figures: every scenario at the settings the documentation shows, as a table and
//! a chart.

use std::fmt::Write as _;
use std::time::Duration;

use super::svg::{Chart, Series};
use super::{Contention, Herd, Jitter, Layers, OpenLoop, Service};
use crate::budget::RetryBudget;
use crate::policy::RetryPolicy;

/// One scenario's output: a table for the terminal and a chart to write as SVG.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Figure {
    /// The SVG file's name, `*.svg`.
    pub file_name: &'static str,
    /// A plain-text table of the numbers behind the chart.
    pub table: String,
    /// The chart.
    pub chart: Chart,
}

/// Every scenario at its standard settings, seeded with `seed`. The same seed gives the same
/// figures, byte for byte.
pub fn figures(seed: u64) -> Vec<Figure> {
    let mut out = contention(seed);
    out.push(outage(seed));
    out.push(herd(seed));
    out.push(layers());
    out
}

fn contention(seed: u64) -> Vec<Figure> {
    let sizes: Vec<u32> = (1..=10).map(|k| k * 10).collect();
    let mut calls = Vec::new();
    let mut times = Vec::new();
    let mut table = String::from(
        "Contention: clients each need one write to a resource busy 10 ms per write; \
         backoff base 10 ms, cap 10 s\n",
    );
    let _ = writeln!(
        table,
        "{:<20} {:>8} {:>12} {:>16}",
        "strategy", "clients", "total calls", "completion (s)"
    );
    for jitter in Jitter::ALL {
        let (mut c, mut t) = (Vec::new(), Vec::new());
        for &clients in &sizes {
            let report = Contention {
                clients,
                write_time: Duration::from_millis(10),
                base: Duration::from_millis(10),
                cap: Duration::from_secs(10),
                jitter,
                seed,
            }
            .run();
            let secs = report.completion.as_secs_f64();
            let _ = writeln!(
                table,
                "{:<20} {:>8} {:>12} {:>16.3}",
                jitter.name(),
                clients,
                report.calls,
                secs
            );
            c.push((f64::from(clients), report.calls as f64));
            t.push((f64::from(clients), secs));
        }
        calls.push(Series::new(jitter.name(), c));
        times.push(Series::new(jitter.name(), t));
    }
    vec![
        Figure {
            file_name: "contention_calls.svg",
            table: table.clone(),
            chart: Chart {
                title: "Contention: calls to write once each, by jitter strategy".into(),
                x_label: "clients contending (count)".into(),
                y_label: "total calls (count)".into(),
                series: calls,
                steps: false,
            },
        },
        Figure {
            file_name: "contention_time.svg",
            table: String::new(),
            chart: Chart {
                title: "Contention: time until every client has written".into(),
                x_label: "clients contending (count)".into(),
                y_label: "completion time (s)".into(),
                series: times,
                steps: false,
            },
        },
    ]
}

fn outage(seed: u64) -> Figure {
    let (start, end) = (Duration::from_secs(20), Duration::from_secs(60));
    let run = |budget: Option<RetryBudget>| {
        OpenLoop {
            rate_per_sec: 100,
            duration: Duration::from_secs(90),
            service: Service::OutageBetween { start, end },
            policy: RetryPolicy::default(),
            budget,
            seed,
        }
        .run()
    };
    let with = run(Some(RetryBudget::default()));
    let without = run(None);
    let mut table = String::from(
        "Outage: 100 requests/s for 90 s, every attempt fails from 20 s to 60 s; 3 attempts\n",
    );
    let _ = writeln!(
        table,
        "{:<22} {:>20} {:>22} {:>14}",
        "budget", "attempts per request", "peak attempts/s (outage)", "success rate"
    );
    for (name, report) in [("ratio 10 % (default)", &with), ("none", &without)] {
        let peak = report
            .attempts_per_second
            .iter()
            .skip(20)
            .take(40)
            .max()
            .copied()
            .unwrap_or(0);
        let _ = writeln!(
            table,
            "{:<22} {:>20.3} {:>22} {:>13.1} %",
            name,
            report.attempts_per_request(),
            peak,
            report.success_rate() * 100.0
        );
    }
    let per_second = |report: &super::Report| {
        report
            .attempts_per_second
            .iter()
            .enumerate()
            .take(90)
            .map(|(s, &n)| (s as f64, n as f64))
            .collect()
    };
    Figure {
        file_name: "outage.svg",
        table,
        chart: Chart {
            title: "Outage from 20 s to 60 s: load on the dependency, 100 requests/s offered"
                .into(),
            x_label: "time (s)".into(),
            y_label: "attempts reaching the server (per second)".into(),
            series: vec![
                Series::new("no budget", per_second(&without)),
                Series::new("default budget", per_second(&with)),
                Series::new("offered load", vec![(0.0, 100.0), (90.0, 100.0)]),
            ],
            steps: true,
        },
    }
}

fn herd(seed: u64) -> Figure {
    let run = |jitter_above_floor: bool| {
        Herd {
            clients: 1000,
            retry_after_secs: 2,
            jitter_above_floor,
            seed,
        }
        .run()
    };
    let with = run(true);
    let without = run(false);
    let mut table = String::from(
        "Herd: 1000 clients get 429 with Retry-After: 2 at time zero; retries per 10 ms\n",
    );
    let _ = writeln!(
        table,
        "{:<26} {:>22} {:>24}",
        "policy", "peak retries per 10 ms", "10 ms buckets with retries"
    );
    for (name, report) in [
        ("jitter above the floor", &with),
        ("no jitter above the floor", &without),
    ] {
        let busy = report
            .arrivals_per_10ms
            .iter()
            .skip(1)
            .filter(|n| **n > 0)
            .count();
        let _ = writeln!(
            table,
            "{:<26} {:>22} {:>24}",
            name,
            report.peak_retries_per_10ms(),
            busy
        );
    }
    let window = |report: &super::HerdReport| {
        (195..=215)
            .map(|bucket| {
                let n = report.arrivals_per_10ms.get(bucket).copied().unwrap_or(0);
                (bucket as f64 / 100.0, n as f64)
            })
            .collect()
    };
    Figure {
        file_name: "herd.svg",
        table,
        chart: Chart {
            title: "1000 clients told Retry-After: 2 at once: arrivals around t = 2 s".into(),
            x_label: "time (s)".into(),
            y_label: "attempts arriving (per 10 ms)".into(),
            series: vec![
                Series::new("no jitter above floor", window(&without)),
                Series::new("jitter above floor", window(&with)),
            ],
            steps: true,
        },
    }
}

fn layers() -> Figure {
    let mut table = String::from(
        "Layers: retrying layers of 3 attempts each over a dead backend (always 503)\n",
    );
    let _ = writeln!(
        table,
        "{:<8} {:>28} {:>30}",
        "layers", "backend attempts, one layer", "backend attempts, every layer"
    );
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for depth in 1..=4 {
        let run = |single_layer_rule: bool| {
            Layers {
                depth,
                attempts_per_layer: 3,
                single_layer_rule,
                requests: 10,
            }
            .run()
            .backend_attempts_per_request
        };
        let (a, b) = (run(true), run(false));
        let _ = writeln!(table, "{depth:<8} {a:>28.1} {b:>30.1}");
        with.push((f64::from(depth), a));
        without.push((f64::from(depth), b));
    }
    Figure {
        file_name: "layers.svg",
        table,
        chart: Chart {
            title: "Stacked retrying layers over a dead backend".into(),
            x_label: "retrying layers on the path (count)".into(),
            y_label: "backend attempts per request (count)".into(),
            series: vec![
                Series::new("every layer retries", without),
                Series::new("one layer retries", with),
            ],
            steps: false,
        },
    }
}
