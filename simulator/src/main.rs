//! Pictures of retry behaviour, from deterministic simulations in virtual time.
//!
//! Runs four scenarios over the crate's real backoff, `Retry-After` handling, budget and
//! middleware: contention for a single-writer resource under four jitter strategies, an outage
//! with and without a retry budget, a herd told to come back at the same instant, and retrying
//! layers stacked over a dead backend. Prints a table per scenario and writes an SVG chart per
//! figure into the folder given with `--out`. The same `--seed` gives byte-identical files.
//!
//! Run it with `cargo run --release -p reqwest-safe-retry-simulator -- --out docs/img`.

use std::path::PathBuf;
use std::process::ExitCode;

use reqwest_safe_retry_simulator::figures;

fn main() -> ExitCode {
    let mut out = None;
    let mut seed = 2015;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--out", Some(dir)) => out = Some(PathBuf::from(dir)),
            ("--seed", Some(value)) => match value.parse() {
                Ok(value) => seed = value,
                Err(_) => return usage(&format!("--seed takes a whole number, not {value:?}")),
            },
            _ => return usage(&format!("unexpected argument {arg:?}")),
        }
    }
    let Some(out) = out else {
        return usage("--out DIR is required");
    };
    if let Err(err) = std::fs::create_dir_all(&out) {
        eprintln!("cannot create {}: {err}", out.display());
        return ExitCode::FAILURE;
    }

    for figure in figures(seed) {
        if !figure.table.is_empty() {
            println!("{}", figure.table);
        }
        let path = out.join(figure.file_name);
        if let Err(err) = std::fs::write(&path, figure.chart.to_svg()) {
            eprintln!("cannot write {}: {err}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {}\n", path.display());
    }
    ExitCode::SUCCESS
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("{problem}\nusage: simulate --out DIR [--seed N]");
    ExitCode::from(2)
}
