//! The standard figures: every scenario at the settings the documentation shows, as a table and
//! a chart.

use std::fmt::Write as _;
use std::time::Duration;

use super::chart::{Chart, Series};
use super::{
    Clients, Contention, DeadConnections, Herd, JITTERS, Jitter, Layers, Metastable, OpenLoop,
    RATE_PER_SEC, Service, TailAtScale, jitter_name,
};
use reqwest_safe_retry::{RetryBudget, RetryPolicy};

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

/// How large the scenarios are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// The settings the documentation shows.
    Full,
    /// A tenth of the traffic and a few of the seeds and sizes, for tests in a debug build:
    /// the same code, the same determinism, in a fraction of the time.
    Small,
}

/// Every scenario at its standard settings, seeded with `seed`. The same seed gives the same
/// figures, byte for byte.
pub fn figures(seed: u64) -> Vec<Figure> {
    figures_at(seed, Scale::Full)
}

/// Every scenario at `scale`, seeded with `seed`.
pub fn figures_at(seed: u64, scale: Scale) -> Vec<Figure> {
    let mut out = contention(seed, scale);
    out.push(outage(seed, scale));
    out.push(herd(seed, scale));
    out.push(layers());
    out.push(metastable(seed, scale));
    out.push(tail(seed, scale));
    out.push(dead_connections(seed, scale));
    out
}

/// Seeds the contention figures average over: each point is a mean, with the lowest and the
/// highest run as its band.
pub const CONTENTION_SEEDS: u64 = 20;

/// The mean, lowest and highest of `values`.
fn spread(values: &[f64]) -> (f64, f64, f64) {
    let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (mean, low, high)
}

fn contention(seed: u64, scale: Scale) -> Vec<Figure> {
    let (sizes, seeds): (Vec<u32>, u64) = match scale {
        Scale::Full => ((1..=10).map(|k| k * 10).collect(), CONTENTION_SEEDS),
        Scale::Small => (vec![10, 30], 3),
    };
    let mut calls = Vec::new();
    let mut times = Vec::new();
    let mut table = format!(
        "Contention: clients each need one write to a resource busy 10 ms per write; \
         backoff base 10 ms, cap 10 s; mean of {seeds} seeds [lowest - highest]\n"
    );
    let _ = writeln!(
        table,
        "{:<20} {:>8} {:>26} {:>32}",
        "strategy", "clients", "total calls", "completion (s)"
    );
    for jitter in JITTERS {
        let (mut c, mut c_band, mut t, mut t_band) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &clients in &sizes {
            let runs: Vec<_> = (seed..seed + seeds)
                .map(|seed| {
                    Contention {
                        clients,
                        write_time: Duration::from_millis(10),
                        base: Duration::from_millis(10),
                        cap: Duration::from_secs(10),
                        jitter,
                        seed,
                    }
                    .run()
                })
                .collect();
            let call_counts: Vec<f64> = runs.iter().map(|r| r.calls as f64).collect();
            let secs: Vec<f64> = runs.iter().map(|r| r.completion.as_secs_f64()).collect();
            let (calls_mean, calls_low, calls_high) = spread(&call_counts);
            let (secs_mean, secs_low, secs_high) = spread(&secs);
            let _ = writeln!(
                table,
                "{:<20} {:>8} {:>10.0} [{:>6.0} - {:>6.0}] {:>12.3} [{:>7.3} - {:>7.3}]",
                jitter_name(jitter),
                clients,
                calls_mean,
                calls_low,
                calls_high,
                secs_mean,
                secs_low,
                secs_high
            );
            let x = f64::from(clients);
            c.push((x, calls_mean));
            c_band.push((x, calls_low, calls_high));
            t.push((x, secs_mean));
            t_band.push((x, secs_low, secs_high));
        }
        // Equal and full jitter make about as many calls: equal's line is dashed, so that it
        // shows where full's covers it.
        let style = |series: Series| match jitter {
            Jitter::Equal => series.dashed(),
            _ => series,
        };
        calls.push(style(
            Series::new(jitter_name(jitter), c)
                .with_band(c_band)
                .with_markers(),
        ));
        times.push(style(
            Series::new(jitter_name(jitter), t)
                .with_band(t_band)
                .with_markers(),
        ));
    }
    vec![
        Figure {
            file_name: "contention_calls.svg",
            table: table.clone(),
            chart: Chart {
                title: format!(
                    "Contention: calls to write once each (mean of {seeds} seeds, band: lowest to highest)"
                ),
                x_label: "clients contending (count)".into(),
                y_label: "total calls (count, log scale)".into(),
                series: calls,
                steps: false,
                log_y: true,
            },
        },
        Figure {
            file_name: "contention_time.svg",
            table: String::new(),
            chart: Chart {
                title: format!(
                    "Contention: time until every client has written (mean of {seeds} seeds)"
                ),
                x_label: "clients contending (count)".into(),
                y_label: "completion time (s, log scale)".into(),
                series: times,
                steps: false,
                log_y: true,
            },
        },
    ]
}

fn outage(seed: u64, scale: Scale) -> Figure {
    let rate = match scale {
        Scale::Full => 100,
        Scale::Small => 10,
    };
    let (start, end) = (Duration::from_secs(20), Duration::from_secs(60));
    let run = |budget: Option<RetryBudget>| {
        OpenLoop {
            rate_per_sec: rate,
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
    let mut table = format!(
        "Outage: {rate} requests/s for 90 s, every attempt fails from 20 s to 60 s; 3 attempts\n"
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
            title: format!(
                "Outage from 20 s to 60 s: load on the dependency, {rate} requests/s offered"
            ),
            x_label: "time (s)".into(),
            y_label: "attempts reaching the server (per second)".into(),
            series: vec![
                Series::new("no budget", per_second(&without)),
                Series::new("default budget", per_second(&with)),
                Series::new(
                    "offered load",
                    vec![(0.0, f64::from(rate)), (89.0, f64::from(rate))],
                )
                .reference(),
            ],
            steps: true,
            log_y: false,
        },
    }
}

fn herd(seed: u64, scale: Scale) -> Figure {
    let clients = match scale {
        Scale::Full => 1000,
        Scale::Small => 100,
    };
    let run = |jitter_above_floor: bool| {
        Herd {
            clients,
            retry_after_secs: 2,
            jitter_above_floor,
            seed,
        }
        .run()
    };
    let with = run(true);
    let without = run(false);
    let mut table = format!(
        "Herd: {clients} clients get 429 with Retry-After: 2 at time zero; retries per 10 ms\n"
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
            title: format!(
                "{clients} clients told Retry-After: 2 at once: arrivals around t = 2 s"
            ),
            x_label: "time (s)".into(),
            y_label: "attempts arriving (per 10 ms)".into(),
            series: vec![
                Series::new("no jitter above floor", window(&without)),
                Series::new("jitter above floor", window(&with)).with_markers(),
            ],
            steps: true,
            log_y: false,
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
            y_label: "backend attempts per request (count, log scale)".into(),
            series: vec![
                Series::new("every layer retries", without).with_markers(),
                Series::new("one layer retries", with).with_markers(),
            ],
            steps: false,
            log_y: true,
        },
    }
}

fn metastable(seed: u64, scale: Scale) -> Figure {
    let capacity = match scale {
        Scale::Full => 100,
        Scale::Small => 10,
    };
    let offered = capacity * 4 / 5;
    let mut table = format!(
        "Metastable: capacity {capacity}/s, {offered}/s offered, capacity halved from 20 s to \
         30 s, attempts time out after 1 s; seconds from the end of the trigger until goodput \
         holds at >= 95 % of the offered load\n"
    );
    let _ = writeln!(
        table,
        "{:<26} {:>22} {:>28}",
        "clients", "recovery (s)", "arrivals/s at 40-50 s (peak)"
    );
    let mut series = Vec::new();
    for clients in Clients::ALL {
        let mut scenario = Metastable::at_capacity(capacity, clients, seed);
        if scale == Scale::Small {
            scenario.duration = Duration::from_secs(45);
        }
        let report = scenario.run();
        let peak = report
            .arrivals_per_second
            .iter()
            .skip(40)
            .take(10)
            .max()
            .copied()
            .unwrap_or(0);
        let recovery = report
            .recovery
            .map_or_else(|| "never (within 90 s)".to_owned(), |s| s.to_string());
        let _ = writeln!(
            table,
            "{:<26} {:>22} {:>28}",
            clients.name(),
            recovery,
            peak
        );
        let points = report
            .goodput_per_second
            .iter()
            .enumerate()
            .map(|(s, &n)| (s as f64, n as f64))
            .collect();
        let line = Series::new(clients.name(), points);
        series.push(match clients {
            Clients::RetriesWithBudget => line.dashed(),
            _ => line,
        });
    }
    let end = match scale {
        Scale::Full => 119.0,
        Scale::Small => 44.0,
    };
    series.push(
        Series::new(
            "offered load",
            vec![(0.0, f64::from(offered)), (end, f64::from(offered))],
        )
        .reference(),
    );
    Figure {
        file_name: "metastable.svg",
        table,
        chart: Chart {
            title: format!(
                "Metastable failure: goodput, capacity {capacity}/s halved from 20 s to 30 s"
            ),
            x_label: "time (s)".into(),
            y_label: "requests that succeeded (per second)".into(),
            series,
            steps: true,
            log_y: false,
        },
    }
}

/// The percentiles the tail figure reads, as numbers of nines: p50, p90, p99, p99.9, p99.99.
const NINES: [(f64, &str); 5] = [
    (0.5, "p50"),
    (0.9, "p90"),
    (0.99, "p99"),
    (0.999, "p99.9"),
    (0.9999, "p99.99"),
];

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1_000.0
}

fn tail(seed: u64, scale: Scale) -> Figure {
    let duration = match scale {
        Scale::Full => Duration::from_secs(60),
        Scale::Small => Duration::from_secs(5),
    };
    let run = |hedge| {
        TailAtScale {
            rate_per_sec: RATE_PER_SEC,
            duration,
            hedge,
            seed,
        }
        .run()
    };
    let (without, with) = (run(false), run(true));
    let mut table = format!(
        "Tail at scale: {RATE_PER_SEC} requests/s for {} s; attempts take 8-12 ms, 1 % take 1 s; \
         request latency (ms)\n",
        duration.as_secs()
    );
    let _ = writeln!(
        table,
        "{:<28} {:>8} {:>8} {:>8} {:>8} {:>12}",
        "client", "p50", "p99", "p99.9", "hedges", "extra load"
    );
    let mut series = Vec::new();
    for (name, report) in [("no hedging", &without), ("hedged after the p95", &with)] {
        let _ = writeln!(
            table,
            "{:<28} {:>8.1} {:>8.1} {:>8.1} {:>8} {:>11.2}%",
            name,
            millis(report.percentile(0.5)),
            millis(report.percentile(0.99)),
            millis(report.percentile(0.999)),
            report.hedges,
            report.extra_load() * 100.0
        );
        let points = NINES
            .iter()
            .map(|(q, _)| (-(1.0 - q).log10(), millis(report.percentile(*q))))
            .collect();
        series.push(Series::new(name, points).with_markers());
    }
    Figure {
        file_name: "tail.svg",
        table,
        chart: Chart {
            title: format!(
                "Tail at scale: request latency by percentile, {RATE_PER_SEC}/s for {} s",
                duration.as_secs()
            ),
            x_label: "percentile (nines: 0.3 = p50, 1 = p90, 2 = p99, 3 = p99.9, 4 = p99.99)"
                .into(),
            y_label: "request latency (ms, log scale)".into(),
            series,
            steps: false,
            log_y: true,
        },
    }
}

fn dead_connections(seed: u64, scale: Scale) -> Figure {
    let rate = match scale {
        Scale::Full => RATE_PER_SEC,
        Scale::Small => 20,
    };
    let duration = Duration::from_secs(60);
    let run = |from_latency| {
        DeadConnections {
            rate_per_sec: rate,
            duration,
            from_latency,
            seed,
        }
        .run()
    };
    let (fixed, measured) = (run(false), run(true));
    let mut table = format!(
        "Dead connections and a brownout: {rate} requests/s for 60 s; attempts take about 10 ms, \
         0.5 % never answer, 5x slower from 15 s to 45 s; request latency (ms)\n"
    );
    let _ = writeln!(
        table,
        "{:<30} {:>8} {:>8} {:>10} {:>34}",
        "attempt timeout", "p50", "p99", "p99.9", "brownout attempts cut that would answer"
    );
    let mut series = Vec::new();
    for (name, report) in [
        ("fixed 10 s", &fixed),
        ("2 x p99.9, from latency", &measured),
    ] {
        let _ = writeln!(
            table,
            "{:<30} {:>8.1} {:>8.1} {:>10.1} {:>26} ({:.2}%)",
            name,
            millis(report.percentile(0.5)),
            millis(report.percentile(0.99)),
            millis(report.percentile(0.999)),
            format!("{} of {}", report.brownout_cut, report.brownout_attempts),
            report.brownout_cut_share() * 100.0
        );
        // The slowest request started in each second.
        let mut worst = vec![Duration::ZERO; duration.as_secs() as usize];
        for (start, took) in &report.timeline {
            let second = (start.as_secs() as usize).min(worst.len() - 1);
            worst[second] = worst[second].max(*took);
        }
        let points = worst
            .iter()
            .enumerate()
            .map(|(s, took)| (s as f64, millis(*took).max(1.0)))
            .collect();
        series.push(Series::new(name, points));
    }
    Figure {
        file_name: "dead_connections.svg",
        table,
        chart: Chart {
            title: format!(
                "Dead connections (0.5 %) and a 5x brownout (15-45 s): slowest request per second, {rate}/s"
            ),
            x_label: "request start (s)".into(),
            y_label: "slowest request that started in the second (ms, log scale)".into(),
            series,
            steps: true,
            log_y: true,
        },
    }
}
