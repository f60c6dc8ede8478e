//! Instructions per request, counted by valgrind's callgrind: the figure to optimise, because
//! it repeats where times on a shared machine drift.
//!
//! Each client of the success path ((a) to (f), see the crate docs) and each of the retry path
//! runs in a process of its own under `valgrind --tool=callgrind`, with its server on the same
//! current-thread runtime: once with N1 requests, once with N2. Start-up, warm-up and exit cost
//! the same in both, so `(Ir(N2) - Ir(N1)) / (N2 - N1)` is the cost of one request, client and
//! server. The server's share is the same for every client, so the differences to (b) are the
//! clients' own.
//!
//! Run with `cargo bench -p reqwest-safe-retry-benches --bench instructions` (needs valgrind:
//! `apt-get install valgrind`). Set `N1` and `N2` to change the request counts, and `ONLY` to
//! one of `success`, `own`, `tower`, `grpc` or `retry` to run that part alone.

use std::process::Command;

use reqwest_safe_retry_benches::{
    Client, Mode, clients, grpc_clients, own_clients, retrying_clients, run, start, start_grpc,
    tower_clients,
};

const CHILD: &str = "REQWEST_SAFE_RETRY_BENCH_CHILD";
const WARM_UP: u64 = 256;

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let n1 = count("N1", 640);
    let n2 = count("N2", 1920);
    assert!(n2 > n1, "N2 ({n2}) must be larger than N1 ({n1})");
    if Command::new("valgrind").arg("--version").output().is_err() {
        eprintln!(
            "valgrind not found: install it (apt-get install valgrind) to count instructions"
        );
        std::process::exit(1);
    }
    println!(
        "instructions per request, callgrind, (Ir at {n2} - Ir at {n1}) / {}",
        n2 - n1
    );
    let only = std::env::var("ONLY").ok();
    let runs = |part: &str| only.as_deref().is_none_or(|only| only == part);
    if runs("success") {
        success(n1, n2);
    }
    if runs("own") {
        own(n1, n2);
    }
    if runs("tower") {
        tower(n1, n2);
    }
    if runs("grpc") {
        grpc(n1, n2);
    }
    if runs("retry") {
        retry(n1, n2);
    }
}

fn success(n1: u64, n2: u64) {
    for in_flight in [1u64, 64] {
        let names: Vec<_> = clients().into_iter().map(|(name, _)| name).collect();
        let per: Vec<f64> = (0..names.len())
            .map(|i| per_request("success", i, in_flight, n1, n2))
            .collect();
        println!("\nsuccess path, {in_flight} in flight");
        println!(
            "{:<24} {:>10} {:>10} {:>8}",
            "client", "Ir/req", "over (b)", "vs (b)"
        );
        for (name, ir) in names.iter().zip(&per) {
            println!(
                "{name:<24} {ir:>10.0} {:>+10.0} {:>8.3}",
                ir - per[1],
                ir / per[1]
            );
        }
    }
}

fn own(n1: u64, n2: u64) {
    println!(
        "\nthe middleware's own instructions per request (counted only inside it: its handle, \
         its future's polls and drop, less the chain beneath it)"
    );
    println!(
        "{:<24} {:>10} {:>10}",
        "client", "1 in flight", "64 in flight"
    );
    let own: Vec<[f64; 2]> = (0..own_clients().len())
        .map(|i| [1, 64].map(|in_flight| per_request("own", i, in_flight, n1, n2)))
        .collect();
    for ((name, _), [one, many]) in own_clients().into_iter().zip(&own) {
        println!("{name:<24} {one:>10.0} {many:>10.0}");
    }
    println!(
        "{:<24} {:>10.0} {:>10.0}",
        "(e) - (c)",
        own[2][0] - own[0][0],
        own[2][1] - own[0][1]
    );
    println!(
        "{:<24} {:>10.0} {:>10.0}",
        "(d) - (c)",
        own[1][0] - own[0][0],
        own[1][1] - own[0][1]
    );
}

fn tower(n1: u64, n2: u64) {
    println!(
        "\ntower clients over hyper-util's client, each sent the same `Full<Bytes>` body (each \
         retrying one over the bare service, (T0))"
    );
    let names: Vec<_> = tower_clients().into_iter().map(|(n, _)| n).collect();
    for in_flight in [1u64, 64] {
        let per: Vec<f64> = (0..names.len())
            .map(|i| per_request("tower", i, in_flight, n1, n2))
            .collect();
        println!("\n{in_flight} in flight");
        println!("{:<32} {:>10} {:>10}", "client", "Ir/req", "over bare");
        for (i, (name, ir)) in names.iter().zip(&per).enumerate() {
            let bare = if i == 0 { *ir } else { per[0] };
            println!("{name:<32} {ir:>10.0} {:>+10.0}", ir - bare);
        }
    }
}

fn grpc(n1: u64, n2: u64) {
    println!(
        "\ngRPC clients over one tonic Channel, each calling a unary method of a tonic server \
         (each over the bare channel, (G0))"
    );
    let names: Vec<_> = grpc_clients().into_iter().map(|(n, _)| n).collect();
    for in_flight in [1u64, 64] {
        let per: Vec<f64> = (0..names.len())
            .map(|i| per_request("grpc", i, in_flight, n1, n2))
            .collect();
        println!("\n{in_flight} in flight");
        println!("{:<32} {:>10} {:>10}", "client", "Ir/call", "over bare");
        for (i, (name, ir)) in names.iter().zip(&per).enumerate() {
            let bare = if i == 0 { *ir } else { per[0] };
            println!("{name:<32} {ir:>10.0} {:>+10.0}", ir - bare);
        }
    }
}

fn retry(n1: u64, n2: u64) {
    let names: Vec<_> = retrying_clients().into_iter().map(|(n, _)| n).collect();
    println!("\nretry path (a 503, then a 200, no backoff), 1 in flight");
    println!("{:<24} {:>10}", "client", "Ir/req");
    for (i, name) in names.iter().enumerate() {
        println!("{name:<24} {:>10.0}", per_request("retry", i, 1, n1, n2));
    }
}

fn count(var: &str, default: u64) -> u64 {
    std::env::var(var).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{var}={v:?} is not a request count"))
    })
}

/// Instructions per request of one client, from two runs under callgrind.
fn per_request(path: &str, client: usize, in_flight: u64, n1: u64, n2: u64) -> f64 {
    let ir = |n| instructions(&format!("{path} {client} {in_flight} {n}"));
    let (low, high) = (ir(n1), ir(n2));
    (high - low) as f64 / (n2 - n1) as f64
}

/// Runs this bench as a child under callgrind; returns the instructions it executed: all of
/// them, or for the `own` path those inside the measured middleware alone (counting is off at
/// the start, turned on by the `measured_*` markers and off by the `beneath_*` ones).
fn instructions(spec: &str) -> u64 {
    let exe = std::env::current_exe().unwrap();
    let own: &[&str] = if spec.starts_with("own ") {
        &[
            "--collect-atstart=no",
            "--toggle-collect=*reqwest_safe_retry_benches::measured_*",
            "--toggle-collect=*reqwest_safe_retry_benches::beneath_*",
        ]
    } else {
        &[]
    };
    let out = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .args(own)
        .arg(exe)
        .env(CHILD, spec)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child {spec:?} failed:\n{stderr}");
    stderr
        .lines()
        .find_map(|line| {
            let (_, total) = line.split_once("Collected :")?;
            total.trim().parse().ok()
        })
        .unwrap_or_else(|| panic!("no instruction count from callgrind:\n{stderr}"))
}

/// The measured process: warm up, then send the requests the spec asks for.
fn child(spec: &str) {
    let parts: Vec<&str> = spec.split(' ').collect();
    let [path, client, in_flight, n] = parts[..] else {
        panic!("bad child spec {spec:?}");
    };
    let (client, in_flight, n): (usize, u64, u64) = (
        client.parse().unwrap(),
        in_flight.parse().unwrap(),
        n.parse().unwrap(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (mode, all) = match path {
            "success" => (Mode::Ok, clients()),
            "own" => (Mode::Ok, own_clients()),
            "retry" => (Mode::FailThenOk, retrying_clients()),
            "tower" => (Mode::Ok, tower_clients()),
            "grpc" => (Mode::Ok, grpc_clients()),
            other => panic!("unknown path {other}"),
        };
        let client: Client = all.into_iter().nth(client).unwrap().1();
        let server = if path == "grpc" {
            start_grpc().await
        } else {
            start(mode).await
        };
        let url = format!("http://{server}/orders");
        assert_eq!(client.post(&url).await, 200);
        run(&client, &url, WARM_UP, in_flight).await;
        run(&client, &url, n, in_flight).await;
    });
}
