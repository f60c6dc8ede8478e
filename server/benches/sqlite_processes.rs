//! Several processes on one SQLite file, in time: the charges example started 1, 2 and 3 times
//! on one new file, and 64 clients on loopback sending each a new key to the processes in turn
//! for `SECONDS` [3], `ROUNDS` [5] times. SQLite runs one writing transaction at a time across
//! every process of the file, so more processes add no writes a second: this measures what they
//! cost instead (the write lock handed between processes, and the busy waits).
//!
//! Run with `cargo build --release -p safe-retry-server --all-features --examples && cargo bench
//! -p safe-retry-server --all-features --bench sqlite_processes` (the bench starts the example's
//! release build).

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The example's release build, beside this bench's.
fn example() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|release| release.join("examples").join("charges"))
        .unwrap();
    assert!(
        path.exists(),
        "no {} yet: run `cargo build --release -p safe-retry-server --all-features --examples` first",
        path.display()
    );
    path
}

async fn start(database: &str) -> (Child, String) {
    let mut child = Command::new(example())
        .args(["--addr", "127.0.0.1:0", "--database-url", database])
        .args(["--effect-delay-ms", "0"])
        .env("RUST_LOG", "off")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next_line().await.unwrap().unwrap();
    let addr = first
        .strip_prefix("charges on http://")
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("the example did not start: {first}"))
        .to_owned();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (rounds, seconds) = (env("ROUNDS", 5), env("SECONDS", 3));
    let dir = std::env::temp_dir().join(format!("safe-retry-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    println!(
        "processes of the charges example on one SQLite file, 64 clients on new keys, \
         {rounds} rounds of {seconds} s; mean [lowest, highest round]"
    );
    println!(
        "{:<12} {:>24} {:>18} {:>14}",
        "processes", "answered 201 a second", "p99 (ms)", "other answers"
    );
    let client = reqwest::Client::new();
    let mut first_rate = 0.0;
    for processes in 1..=3 {
        let database = format!("sqlite://{}", dir.join(format!("{processes}.db")).display());
        let mut children = Vec::new();
        let mut addrs = Vec::new();
        for _ in 0..processes {
            let (child, addr) = start(&database).await;
            children.push(child);
            addrs.push(addr);
        }
        let addrs = Arc::new(addrs);
        let (mut rates, mut p99s, mut others) = (Vec::new(), Vec::new(), 0u64);
        static ROUND: AtomicU64 = AtomicU64::new(0);
        for _ in 0..rounds {
            let round = ROUND.fetch_add(1, Ordering::Relaxed);
            let stop = Arc::new(AtomicBool::new(false));
            let began = Instant::now();
            let clients: Vec<_> = (0..64)
                .map(|c| {
                    let (client, addrs, stop) = (client.clone(), addrs.clone(), stop.clone());
                    tokio::spawn(async move {
                        let (mut times, mut other) = (Vec::new(), 0u64);
                        let mut i = 0usize;
                        while !stop.load(Ordering::Relaxed) {
                            let addr = &addrs[(c + i) % addrs.len()];
                            let sent = Instant::now();
                            let answer = client
                                .post(format!("http://{addr}/charges"))
                                .header("idempotency-key", format!("r{round}-c{c}-{i}"))
                                .body("{\"amount\":1000,\"cur\":\"EU\"}")
                                .send()
                                .await;
                            match answer {
                                Ok(answer) if answer.status() == 201 => {
                                    let _ = answer.bytes().await;
                                    times.push(sent.elapsed());
                                }
                                _ => other += 1,
                            }
                            i += 1;
                        }
                        (times, other)
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_secs(seconds)).await;
            stop.store(true, Ordering::Relaxed);
            let mut times = Vec::new();
            for client in clients {
                let (t, o) = client.await.unwrap();
                times.extend(t);
                others += o;
            }
            let elapsed = began.elapsed().as_secs_f64();
            times.sort();
            rates.push(times.len() as f64 / elapsed);
            p99s.push(times[times.len() * 99 / 100].as_secs_f64() * 1e3);
        }
        if processes == 1 {
            first_rate = mean(&rates);
        }
        println!(
            "{:<12} {:>24} {:>18} {:>14}   {:.2} × one process",
            processes,
            spread(&rates),
            spread(&p99s),
            others,
            mean(&rates) / first_rate
        );
        for mut child in children {
            let _ = child.kill().await;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

fn spread(values: &[f64]) -> String {
    let low = values.iter().cloned().fold(f64::INFINITY, f64::min);
    let high = values.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.0} [{:.0}, {:.0}]", mean(values), low, high)
}
