//! The layer's cost per request on SQLite, in instructions counted by valgrind's callgrind
//! (the database is in the process, so every instruction it runs is counted too).
//!
//! Three services answer the same 26-byte POST: the floor, a handler that writes its effect in a
//! transaction of its own; the baseline, the same handler doing the layer's claim and completion
//! statements by hand (`common::by_hand`); and the first handler behind the layer, writing its
//! effect in the transaction that stores the answer. Each runs in a process of its own on a current-thread
//! runtime, called in the process (no sockets), once with N1 requests and once with N2, each
//! with a new key; `(Ir(N2) - Ir(N1)) / (N2 - N1)` is one request's cost.
//!
//! Run with `cargo bench -p safe-retry-server --bench instructions` (needs valgrind:
//! `apt-get install valgrind`). Set `N1` and `N2` to change the request counts.

mod common;

use std::process::Command;

use safe_retry_server::SqliteStore;

const CHILD: &str = "SAFE_RETRY_SERVER_BENCH_CHILD";

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let count = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (n1, n2) = (count("N1", 200), count("N2", 600));
    assert!(n2 > n1, "N2 ({n2}) must be larger than N1 ({n1})");
    if Command::new("valgrind").arg("--version").output().is_err() {
        eprintln!(
            "valgrind not found: install it (apt-get install valgrind) to count instructions"
        );
        std::process::exit(1);
    }
    println!(
        "instructions per request on SQLite, callgrind, (Ir at {n2} - Ir at {n1}) / {}",
        n2 - n1
    );
    let per = |service: &str| {
        (instructions(&format!("{service} {n2}")) - instructions(&format!("{service} {n1}"))) as f64
            / (n2 - n1) as f64
    };
    let bare = per("bare");
    let by_hand = per("by_hand");
    let layered = per("layered");
    println!("{:<44} {:>12}", "service", "Ir/request");
    println!(
        "{:<44} {:>12.0}",
        "(a) handler, own transaction (floor)", bare
    );
    println!(
        "{:<44} {:>12.0}",
        "(c) the layer's statements by hand", by_hand
    );
    println!(
        "{:<44} {:>12.0}",
        "(b) (a)'s handler behind the layer", layered
    );
    println!(
        "{:<44} {:>+12.0} ({:.2}x)",
        "the layer's cost, (b) - (a)",
        layered - bare,
        layered / bare
    );
    println!(
        "{:<44} {:>+12.0} ({:.2}x)",
        "over the statements by hand, (b) - (c)",
        layered - by_hand,
        layered / by_hand
    );
}

fn instructions(spec: &str) -> u64 {
    let out = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .arg(std::env::current_exe().unwrap())
        .env(CHILD, spec)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child {spec:?} failed:\n{stderr}");
    stderr
        .lines()
        .find_map(|line| line.split_once("Collected :")?.1.trim().parse().ok())
        .unwrap_or_else(|| panic!("no instruction count from callgrind:\n{stderr}"))
}

/// The measured process: a new database, a warm-up, then the requests.
fn child(spec: &str) {
    let (service, n) = spec.split_once(' ').expect("a spec is 'service n'");
    let n: u64 = n.parse().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let dir =
            std::env::temp_dir().join(format!("safe-retry-server-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = SqliteStore::open(&format!("sqlite://{}", dir.join("bench.db").display()))
            .await
            .unwrap();
        common::ChargesDb::prepare(&store).await.unwrap();
        let mut router = match service {
            "bare" => common::bare(store),
            "by_hand" => common::by_hand(store),
            "layered" => common::layered(store),
            other => panic!("no service {other:?}"),
        };
        for i in 0..32 {
            assert_eq!(common::call(&mut router, &format!("warm-{i}")).await, 201);
        }
        for i in 0..n {
            assert_eq!(common::call(&mut router, &format!("key-{i}")).await, 201);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    });
}
