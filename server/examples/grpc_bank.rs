//! A tonic service behind the gRPC front, called through this workspace's gRPC door: each
//! `bank.Bank/Charge` call writes an order row, charges a payment provider and sends a
//! receipt through the outbox, once per call, through a link that resets connections and drops
//! answers.
//!
//! ```sh
//! cargo run -p safe-retry-server --features grpc --example grpc_bank
//! ```
//!
//! Options: `--calls N` [100], `--seed N` [the link's draws; 101], `--database-url URL` [a new
//! SQLite file in the temporary directory, removed at the end; `postgres://…` with
//! `--features postgres`; `mysql://…` with `--features mysql`].
//!
//! `--serve` runs the bank alone, as a process a test kills: it prints `listening ADDR`, and
//! takes `--addr` [127.0.0.1:0], `--database-url`, `--payments-url URL`, `--receipts-url URL`,
//! `--lease-ms` [30000], `--every-ms` [500] (the reconciler and the relay), and `--crash-at
//! POINT`, where the first call to reach POINT prints `reached POINT` and stops for the process
//! to be killed (`before-order`, `after-order`, `after-charge-call`, `after-charge`,
//! `after-receipt`).

#[allow(dead_code)]
#[path = "support/bank.rs"]
mod bank;
#[allow(dead_code)]
#[path = "support/charges_app.rs"]
mod charges_app;
#[allow(dead_code)]
#[path = "support/grpc_halves.rs"]
mod grpc_halves;
#[allow(dead_code)]
#[path = "support/lossy_link.rs"]
mod lossy_link;
#[allow(dead_code)]
#[path = "support/orders_app.rs"]
mod orders_app;
#[allow(dead_code)]
#[path = "support/receiver.rs"]
mod receiver;

use std::sync::Arc;
use std::time::Duration;

use charges_app::ChargesDb;
use lossy_link::Fate;
use orders_app::{Crash, Faults, Orders, POINTS};
use safe_retry_server::{IdempotencyLayer, Relay};

struct Options {
    serve: bool,
    addr: String,
    database_url: Option<String>,
    calls: usize,
    seed: u64,
    payments: Option<String>,
    receipts: Option<String>,
    crash_at: Option<String>,
    lease: Duration,
    every: Duration,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        serve: false,
        addr: "127.0.0.1:0".into(),
        database_url: None,
        calls: 100,
        seed: 101,
        payments: None,
        receipts: None,
        crash_at: None,
        lease: Duration::from_secs(30),
        every: Duration::from_millis(500),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |text: String| {
            text.parse::<u64>()
                .map_err(|_| format!("{flag} takes a number, not {text:?}"))
        };
        match flag.as_str() {
            "--serve" => options.serve = true,
            "--addr" => options.addr = value()?,
            "--database-url" => options.database_url = Some(value()?),
            "--calls" => options.calls = number(value()?)? as usize,
            "--seed" => options.seed = number(value()?)?,
            "--payments-url" => options.payments = Some(value()?),
            "--receipts-url" => options.receipts = Some(value()?),
            "--crash-at" => {
                let point = value()?;
                if !POINTS.contains(&point.as_str()) {
                    return Err(format!(
                        "--crash-at {point:?} is not a recovery point; the points are {}",
                        POINTS.join(", ")
                    ));
                }
                options.crash_at = Some(point);
            }
            "--lease-ms" => options.lease = Duration::from_millis(number(value()?)?),
            "--every-ms" => options.every = Duration::from_millis(number(value()?)?.max(1)),
            other => {
                return Err(format!(
                    "unknown option {other:?}; the options are --calls, --seed, --database-url, and with \
                     --serve: --addr, --payments-url, --receipts-url, --lease-ms, --every-ms, --crash-at"
                ));
            }
        }
    }
    if options.serve && (options.payments.is_none() || options.receipts.is_none()) {
        return Err("--serve needs --payments-url and --receipts-url".into());
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = options()?;
    let (url, own_file) = match &options.database_url {
        Some(url) => (url.clone(), None),
        None => {
            let file =
                std::env::temp_dir().join(format!("safe-retry-bank-{}.db", std::process::id()));
            (format!("sqlite://{}", file.display()), Some(file))
        }
    };
    let result = if url.starts_with("postgres") {
        #[cfg(feature = "postgres")]
        {
            let store = safe_retry_server::PostgresStore::connect(&url).await?;
            run(store, options).await
        }
        #[cfg(not(feature = "postgres"))]
        Err("a postgres:// database needs the postgres feature: cargo run -p safe-retry-server --features grpc,postgres --example grpc_bank".into())
    } else if url.starts_with("mysql") || url.starts_with("mariadb") {
        #[cfg(feature = "mysql")]
        {
            let store = safe_retry_server::MySqlStore::connect(&url).await?;
            run(store, options).await
        }
        #[cfg(not(feature = "mysql"))]
        Err("a mysql:// database needs the mysql feature: cargo run -p safe-retry-server --features grpc,mysql --example grpc_bank".into())
    } else {
        let store = safe_retry_server::SqliteStore::open(&url).await?;
        run(store, options).await
    };
    if let Some(file) = own_file {
        for end in ["", "-wal", "-shm", "-journal"] {
            let _ = std::fs::remove_file(format!("{}{end}", file.display()));
        }
    }
    result
}

async fn run<S: ChargesDb>(store: S, options: Options) -> Result<(), Box<dyn std::error::Error>> {
    if options.serve {
        return serve(store, options).await;
    }
    println!(
        "{} charges through the gRPC door, over a link that resets connections and drops answers (seed {})",
        options.calls, options.seed
    );
    let halves = Arc::new(grpc_halves::Halves::start(store, options.seed).await?);
    let answers = halves.charge_many(options.calls, 16).await;
    let answered = answers.iter().filter(|a| a.is_ok()).count();
    let fates = halves.link.fates.lock().unwrap().clone();
    let count = |fate: Fate| fates.iter().filter(|f| **f == fate).count();
    let counts = halves.layer.counters().snapshot();
    let rows = halves.store.effects().await?.len();
    let charges = halves.payments.effects().len();
    println!(
        "the link: {} connections; {} reset before the server saw the call, {} answers dropped, {} cut short",
        fates.len(),
        count(Fate::ResetBefore),
        count(Fate::DropAnswer),
        count(Fate::CutSoon)
    );
    println!(
        "the bank: {} handler starts ({} taking over a call whose caller was cut off), {} stored answers sent again",
        counts.claims, counts.takeovers, counts.replays
    );
    println!(
        "answered {answered} of {} calls; order rows: {rows}; charges at the provider: {charges}",
        options.calls
    );
    let once = answered == options.calls && rows == options.calls && charges == options.calls;
    println!(
        "{}",
        if once {
            "every call charged exactly once"
        } else {
            "A PROMISE BROKE"
        }
    );
    if once {
        Ok(())
    } else {
        Err("a call was lost or charged twice".into())
    }
}

/// The bank alone, with its reconciler and relay: the process the crash test kills.
async fn serve<S: ChargesDb>(store: S, options: Options) -> Result<(), Box<dyn std::error::Error>> {
    store.prepare().await?;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .grpc_method(bank::CHARGE)
        .lease(options.lease)
        .in_progress_retry_after(Duration::from_millis(50))
        .build_grpc()?;
    let faults = Faults::announced();
    if let Some(point) = &options.crash_at {
        faults.arm(point, Crash::Hang);
    }
    let client = orders_app::dependencies(Duration::from_millis(250));
    let bank = bank::Bank::new(Orders {
        client: client.clone(),
        payments: options.payments.clone().unwrap_or_default(),
        receipts: options.receipts.clone().unwrap_or_default(),
        faults: Arc::new(faults),
    });
    tokio::spawn(layer.reconciler(bank.clone()).run(options.every));
    let relay = Relay::new(store.clone(), client)
        .lease(Duration::from_secs(1))
        .retry_after(Duration::from_millis(200));
    tokio::spawn(relay.run(options.every));
    let listener = tokio::net::TcpListener::bind(&options.addr).await?;
    let served = bank::serve(layer, bank, listener);
    println!("listening {}", served.addr);
    std::future::pending::<()>().await;
    Ok(())
}
