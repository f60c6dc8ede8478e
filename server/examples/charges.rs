//! A charges service behind the idempotency layer: see each charge happen once, however often
//! a client retries it.
//!
//! ```sh
//! cargo run -p safe-retry-server --example charges
//! # in another shell: the same key three times, one effect
//! for i in 1 2 3; do
//!   curl -s -XPOST -H 'Idempotency-Key: order-42' -d 'amount=1000' 127.0.0.1:8090/charges; echo
//! done
//! curl -s '127.0.0.1:8090/effects?key=order-42'; echo
//! ```
//!
//! Options: `--addr` [127.0.0.1:8090], `--database-url` [a SQLite file in a new temporary
//! directory; `postgres://…` with `--features postgres`], `--effect-delay-ms` [50]: how long
//! a charge works before it writes its effect.

#[path = "support/charges_app.rs"]
mod charges_app;

use std::time::Duration;

use safe_retry_server::IdempotencyLayer;

struct Options {
    addr: String,
    database_url: Option<String>,
    effect_delay: Duration,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        addr: "127.0.0.1:8090".into(),
        database_url: None,
        effect_delay: Duration::from_millis(50),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => options.addr = value()?,
            "--database-url" => options.database_url = Some(value()?),
            "--effect-delay-ms" => {
                let ms = value()?;
                let ms: u64 = ms
                    .parse()
                    .map_err(|_| format!("--effect-delay-ms takes milliseconds, not {ms:?}"))?;
                options.effect_delay = Duration::from_millis(ms);
            }
            other => {
                return Err(format!(
                    "unknown option {other:?}; the options are --addr, --database-url, --effect-delay-ms"
                ));
            }
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = options()?;
    let listener = tokio::net::TcpListener::bind(&options.addr).await?;
    let addr = listener.local_addr()?;
    let url = match options.database_url {
        Some(url) => url,
        None => {
            let dir =
                std::env::temp_dir().join(format!("safe-retry-charges-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            format!("sqlite://{}", dir.join("charges.db").display())
        }
    };
    let router = if url.starts_with("postgres") {
        #[cfg(feature = "postgres")]
        {
            use charges_app::ChargesDb;
            let store = safe_retry_server::PostgresStore::connect(&url).await?;
            store.prepare().await?;
            charges_app::app(
                IdempotencyLayer::builder(store).build()?,
                options.effect_delay,
            )
        }
        #[cfg(not(feature = "postgres"))]
        return Err("a postgres:// database needs the postgres feature: cargo run -p safe-retry-server --features postgres --example charges".into());
    } else {
        use charges_app::ChargesDb;
        let store = safe_retry_server::SqliteStore::open(&url).await?;
        store.prepare().await?;
        charges_app::app(
            IdempotencyLayer::builder(store).build()?,
            options.effect_delay,
        )
    };
    println!("charges on http://{addr} (database: {url})");
    println!("  POST /charges with an Idempotency-Key header: one effect per key");
    println!("  GET  /effects?q=TEXT&key=K, GET /health");
    axum::serve(listener, router).await?;
    Ok(())
}
