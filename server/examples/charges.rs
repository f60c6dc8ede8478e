//! A charges service behind the idempotency layer: see each charge happen once, however often
//! a client retries it, and however its process dies.
//!
//! ```sh
//! cargo run -p safe-retry-server --example charges
//! # in another shell: the same key three times, one effect
//! for i in 1 2 3; do
//!   curl -s -XPOST -H 'Idempotency-Key: order-42' -d 'amount=1000' 127.0.0.1:8090/charges; echo
//! done
//! curl -s '127.0.0.1:8090/effects?key=order-42'; echo
//!
//! # the README's charge walk-through: a process killed with SIGKILL at each recovery point,
//! # a new one on the same database, and what the payment provider and receipt service did
//! cargo run -p safe-retry-server --example charges -- --walkthrough
//! ```
//!
//! Options: `--addr` [127.0.0.1:8090], `--database-url` [a new SQLite file for this run, in the
//! temporary directory, printed at start and removed when the demo is stopped with Ctrl-C;
//! `sqlite://charges.db` keeps one across runs and restarts; `postgres://…` with `--features
//! postgres`; `mysql://…` (MySQL 8 or MariaDB 10.11+) with `--features mysql`], `--effect-delay-ms` [50]: how long a charge works before it writes its effect.
//! Any number of processes may start on one new database at once.
//!
//! The external call: `--payments-url URL` and `--receipts-url URL` turn on `POST /orders`
//! (an order row, a charge at `URL/charges` through this workspace's client, a receipt to
//! `URL/receipts` through the outbox), with the reconciler and the outbox relay running every
//! `--every-ms` [500]. `--lease-ms` [30000] sets the lease. `--crash-at POINT` (off by
//! default) is the fault injection: the first order to reach POINT prints `reached POINT` and
//! stops there for the process to be killed; the points are `before-order`, `after-order`,
//! `after-charge-call`, `after-charge`, `after-receipt`. `--call-timeout-ms` [250] bounds
//! each attempt of the charge and receipt calls.
//!
//! The operator's view and `/metrics` are served on `--ops-addr` [127.0.0.1:0, printed at
//! start]; `--header-read-timeout-ms` [5000] cuts off a client that sends its headers slowly;
//! the layer's events go to standard error, filtered by `RUST_LOG` [info].
//!
//! `--walkthrough` runs the crash walk-through on loopback and prints it; with
//! `--database-url postgres://…` each point gets a schema of its own there, with
//! `mysql://…` a database of its own.

#[path = "support/charges_app.rs"]
mod charges_app;
#[allow(dead_code)]
#[path = "support/orders_app.rs"]
mod orders_app;
#[allow(dead_code)]
#[path = "support/receiver.rs"]
mod receiver;
#[allow(dead_code)]
#[path = "support/walkthrough.rs"]
mod walkthrough;

/// Serving with a bound on a request's headers: a client that sends them slowly (a few bytes a
/// second) is cut off after the timeout instead of holding a connection for as long as it likes.
mod serving {
    use std::time::Duration;

    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;

    pub async fn serve(
        listener: tokio::net::TcpListener,
        router: axum::Router,
        header_read_timeout: Duration,
    ) -> std::io::Result<()> {
        let mut builder = Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(header_read_timeout);
        loop {
            let (stream, _) = listener.accept().await?;
            let service = TowerToHyperService::new(router.clone());
            let builder = builder.clone();
            tokio::spawn(async move {
                let _ = builder
                    .serve_connection_with_upgrades(TokioIo::new(stream), service)
                    .await;
            });
        }
    }
}

use std::sync::Arc;
use std::time::Duration;

use charges_app::ChargesDb;
use orders_app::{Crash, Faults, Orders, POINTS};
use safe_retry_server::operator::OperatorView;
use safe_retry_server::{IdempotencyLayer, Relay, Sweeper};

struct Options {
    addr: String,
    database_url: Option<String>,
    effect_delay: Duration,
    payments: Option<String>,
    receipts: Option<String>,
    crash_at: Option<String>,
    lease: Duration,
    every: Duration,
    ops_addr: String,
    header_read_timeout: Duration,
    call_timeout: Duration,
    walkthrough: bool,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        addr: "127.0.0.1:8090".into(),
        database_url: None,
        effect_delay: Duration::from_millis(50),
        payments: None,
        receipts: None,
        crash_at: None,
        lease: Duration::from_secs(30),
        every: Duration::from_millis(500),
        ops_addr: "127.0.0.1:0".into(),
        header_read_timeout: Duration::from_secs(5),
        call_timeout: Duration::from_millis(250),
        walkthrough: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let millis = |text: String| {
            text.parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|_| format!("{flag} takes milliseconds, not {text:?}"))
        };
        match flag.as_str() {
            "--addr" => options.addr = value()?,
            "--database-url" => options.database_url = Some(value()?),
            "--effect-delay-ms" => options.effect_delay = millis(value()?)?,
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
            "--lease-ms" => options.lease = millis(value()?)?,
            "--every-ms" => options.every = millis(value()?)?.max(Duration::from_millis(1)),
            "--ops-addr" => options.ops_addr = value()?,
            "--header-read-timeout-ms" => options.header_read_timeout = millis(value()?)?,
            "--call-timeout-ms" => options.call_timeout = millis(value()?)?,
            "--walkthrough" => options.walkthrough = true,
            other => {
                return Err(format!(
                    "unknown option {other:?}; the options are --addr, --database-url, --effect-delay-ms, \
                     --payments-url, --receipts-url, --crash-at, --lease-ms, --every-ms, --ops-addr, \
                     --header-read-timeout-ms, --call-timeout-ms, --walkthrough"
                ));
            }
        }
    }
    if options.payments.is_some() != options.receipts.is_some() {
        return Err("--payments-url and --receipts-url go together".into());
    }
    if options.crash_at.is_some() && options.payments.is_none() {
        return Err(
            "--crash-at needs the external call: give --payments-url and --receipts-url".into(),
        );
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The layer's events on standard error, filtered by `RUST_LOG` [info].
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let options = options()?;
    if options.walkthrough {
        return walk(options.database_url).await;
    }
    let listener = tokio::net::TcpListener::bind(&options.addr).await?;
    let (url, own_file) = match &options.database_url {
        Some(url) => (url.clone(), None),
        // A database of this run's own: what the README shows (the first charge is effect 1)
        // holds whatever ran before. `--database-url sqlite://charges.db` keeps one across
        // restarts (and a charge retried across a restart is still made once).
        None => {
            let file =
                std::env::temp_dir().join(format!("safe-retry-charges-{}.db", std::process::id()));
            (format!("sqlite://{}", file.display()), Some(file))
        }
    };
    if let Some(file) = own_file {
        // Ctrl-C (or a SIGTERM) ends the demo and removes its database.
        tokio::spawn(async move {
            let code = stopped().await;
            for end in ["", "-wal", "-shm", "-journal"] {
                let _ = std::fs::remove_file(format!("{}{end}", file.display()));
            }
            std::process::exit(code);
        });
    }
    if url.starts_with("postgres") {
        #[cfg(feature = "postgres")]
        {
            let store = safe_retry_server::PostgresStore::connect(&url).await?;
            return serve(store, &url, options, listener).await;
        }
        #[cfg(not(feature = "postgres"))]
        return Err("a postgres:// database needs the postgres feature: cargo run -p safe-retry-server --features postgres --example charges".into());
    }
    if url.starts_with("mysql") || url.starts_with("mariadb") {
        #[cfg(feature = "mysql")]
        {
            let store = safe_retry_server::MySqlStore::connect(&url).await?;
            return serve(store, &url, options, listener).await;
        }
        #[cfg(not(feature = "mysql"))]
        return Err("a mysql:// database needs the mysql feature: cargo run -p safe-retry-server --features mysql --example charges".into());
    }
    let store = safe_retry_server::SqliteStore::open(&url).await?;
    serve(store, &url, options, listener).await
}

/// Waits for Ctrl-C or, on Unix, a SIGTERM, and returns the exit code a shell gives each.
async fn stopped() -> i32 {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut term) = signal(SignalKind::terminate()) else {
            return ctrl_c().await;
        };
        tokio::select! {
            code = ctrl_c() => code,
            _ = term.recv() => 143,
        }
    }
    #[cfg(not(unix))]
    ctrl_c().await
}

async fn ctrl_c() -> i32 {
    match tokio::signal::ctrl_c().await {
        Ok(()) => 130,
        // No handler could be installed: the database stays, as any other file would.
        Err(_) => std::future::pending().await,
    }
}

async fn serve<S: ChargesDb + safe_retry_server::store::Operations>(
    store: S,
    url: &str,
    options: Options,
    listener: tokio::net::TcpListener,
) -> Result<(), Box<dyn std::error::Error>> {
    store.prepare().await?;
    let addr = listener.local_addr()?;
    // The layer's counters register with the recorder installed before it is built.
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .lease(options.lease)
        .build()?;
    let mut router = charges_app::app(layer.clone(), options.effect_delay);
    // Expired records and messages leave in batches, every minute.
    tokio::spawn(Sweeper::new(store.clone()).run(Duration::from_secs(60)));
    let mut ops = OperatorView::new(store.clone());
    let external = options.payments.clone().zip(options.receipts.clone());
    if let Some((payments, receipts)) = &external {
        let faults = Faults::announced();
        if let Some(point) = &options.crash_at {
            faults.arm(point, Crash::Hang);
        }
        // This workspace's client: 3 attempts a call, 250 ms each at most (`--call-timeout-ms`).
        let client = orders_app::dependencies(options.call_timeout);
        let orders = orders_app::orders_app(
            layer.clone(),
            Orders {
                client: client.clone(),
                payments: payments.clone(),
                receipts: receipts.clone(),
                faults: Arc::new(faults),
            },
        );
        router = router.merge(orders.clone());
        // A retry from the operator's view runs the reconciler at once.
        let nudged = Arc::new(layer.reconciler(orders.clone()));
        ops = ops.on_retry(move || {
            let reconciler = nudged.clone();
            async move {
                let _ = reconciler.tick().await;
            }
        });
        tokio::spawn(layer.reconciler(orders).run(options.every));
        let relay = Relay::new(store.clone(), client)
            .lease(Duration::from_secs(1))
            .retry_after(Duration::from_millis(200));
        tokio::spawn(relay.run(options.every));
    }
    println!("charges on http://{addr} (database: {url})");
    println!("  POST /charges with an Idempotency-Key header: one effect per key");
    if let Some((payments, receipts)) = &external {
        println!(
            "  POST /orders: an order row, a charge at {payments}/charges, a receipt to {receipts}/receipts"
        );
    }
    println!("  GET  /effects?q=TEXT&key=K, GET /health");
    // The operator's view and the metrics on an address of their own (loopback by default):
    // put it behind your authentication before it leaves the machine.
    let ops_listener = tokio::net::TcpListener::bind(&options.ops_addr).await?;
    println!(
        "operator's view on http://{}/ops, metrics on /metrics",
        ops_listener.local_addr()?
    );
    let gauges = ops.clone();
    tokio::spawn(async move {
        loop {
            let _ = gauges.tally().await;
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    });
    let admin = axum::Router::new().nest("/ops", ops.router()).route(
        "/metrics",
        axum::routing::get(move || std::future::ready(metrics.render())),
    );
    let timeout = options.header_read_timeout;
    tokio::spawn(async move { serving::serve(ops_listener, admin, timeout).await });
    serving::serve(listener, router, options.header_read_timeout).await?;
    Ok(())
}

/// The crash walk-through, printed.
async fn walk(database_url: Option<String>) -> Result<(), Box<dyn std::error::Error>> {
    let binary = std::env::current_exe()?;
    let dir = std::env::temp_dir().join(format!("safe-retry-walk-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let database = |point: &str| match &database_url {
        Some(url) => walk_databases::url_of(url, point),
        None => format!("sqlite://{}", dir.join(format!("{point}.db")).display()),
    };
    if let Some(url) = &database_url {
        walk_databases::make(url, true).await?;
    }
    println!("an order: claim → order row → charge (downstream key) → receipt (outbox) → answer");
    println!(
        "each run is killed with SIGKILL at the point; a new process on the same database finishes it\n"
    );
    println!(
        "{:<18} {:<15} {:>8} {:>13} {:>9} {:>14} {:>11}  {:<10} answers",
        "killed at",
        "finished by",
        "charges",
        "charge calls",
        "receipts",
        "receipt calls",
        "order rows",
        "outbox",
    );
    let walked = walkthrough::walk_all(&binary, database).await;
    for w in &walked {
        println!(
            "{:<18} {:<15} {:>8} {:>13} {:>9} {:>14} {:>11}  {:<10} {}",
            w.point,
            w.finished_by,
            w.charges,
            w.charge_calls,
            w.receipts,
            w.receipt_calls,
            w.order_rows,
            w.outbox.0,
            if w.answers_identical {
                "identical"
            } else {
                "DIFFER"
            }
        );
    }
    let once = walked.iter().all(|w| {
        w.charges == 1
            && w.receipts == 1
            && w.order_rows == 1
            && w.outbox.0 == "sent"
            && w.answers_identical
    });
    println!(
        "\n{}",
        if once {
            "every point: one charge, one receipt, one order row, one answer"
        } else {
            "A PROMISE BROKE"
        }
    );
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(url) = &database_url {
        walk_databases::make(url, false).await?;
    }
    if once {
        Ok(())
    } else {
        Err("a crash point broke a promise".into())
    }
}

/// A database of its own per crash point of the walk-through, on a server: a schema on
/// PostgreSQL, a database on MySQL.
mod walk_databases {
    use super::{POINTS, walkthrough};

    fn name_of(point: &str) -> String {
        format!("walk_{}_{}", std::process::id(), point.replace('-', "_"))
    }

    /// The URL of `point`'s database on the server at `url`.
    pub fn url_of(url: &str, point: &str) -> String {
        let name = name_of(point);
        if url.starts_with("postgres") {
            let separator = if url.contains('?') { '&' } else { '?' };
            format!("{url}{separator}options=-csearch_path%3D{name}")
        } else {
            let (base, query) = url.split_once('?').unwrap_or((url, ""));
            let base = base.rsplit_once('/').map_or(base, |(head, _)| head);
            let query = if query.is_empty() {
                String::new()
            } else {
                format!("?{query}")
            };
            format!("{base}/{name}{query}")
        }
    }

    /// Makes (`create`) or drops every point's database.
    pub async fn make(url: &str, create: bool) -> Result<(), Box<dyn std::error::Error>> {
        let points = POINTS.into_iter().chain([walkthrough::AFTER_DELIVERY]);
        if url.starts_with("postgres") {
            #[cfg(feature = "postgres")]
            {
                let admin = sqlx::PgPool::connect(url).await?;
                for point in points {
                    let sql = if create {
                        format!("CREATE SCHEMA {}", name_of(point))
                    } else {
                        format!("DROP SCHEMA {} CASCADE", name_of(point))
                    };
                    sqlx::query(sqlx::AssertSqlSafe(sql))
                        .execute(&admin)
                        .await?;
                }
                return Ok(());
            }
        } else if url.starts_with("mysql") || url.starts_with("mariadb") {
            #[cfg(feature = "mysql")]
            {
                let admin = sqlx::MySqlPool::connect(url).await?;
                for point in points {
                    let sql = if create {
                        format!("CREATE DATABASE {}", name_of(point))
                    } else {
                        format!("DROP DATABASE {}", name_of(point))
                    };
                    sqlx::query(sqlx::AssertSqlSafe(sql))
                        .execute(&admin)
                        .await?;
                }
                return Ok(());
            }
        }
        let _ = (points, create);
        Err(
            format!("the walk-through runs on SQLite, or on a server its feature is on for: {url}")
                .into(),
        )
    }
}
