//! A consumer of order events behind the consumer front: each event writes an order row,
//! charges a payment provider and publishes a receipt through the outbox to the broker, once
//! per event id, however often the broker delivers it.
//!
//! ```sh
//! cargo run -p safe-retry-server --features rabbitmq,nats --example order_events
//! cargo run -p safe-retry-server --features rabbitmq,nats --example order_events -- --broker nats
//! ```
//!
//! It needs the broker on this machine: RabbitMQ at 127.0.0.1:5672 (guest/guest;
//! `SAFE_RETRY_RABBITMQ_URL`) or NATS with JetStream at 127.0.0.1:4222
//! (`SAFE_RETRY_NATS_URL`). It makes a queue (or a stream) of its own and removes it at the end.
//!
//! Options: `--broker rabbitmq|nats` [rabbitmq], `--events N` [20], `--database-url URL` [a new
//! SQLite file in the temporary directory, removed at the end; `postgres://…` with
//! `--features postgres`; `mysql://…` with `--features mysql`].
//!
//! `--consume` runs the consumer alone, as a process a test kills: it prints `consuming` once
//! its consumer runs, and takes `--broker`, `--database-url`, `--source NAME` (the queue, or the
//! subject), `--dead-letters NAME` (a queue, or a subject), `--stream NAME` and `--consumer NAME`
//! (JetStream's), `--key-header NAME` (read the key from this header instead of the message id),
//! `--payments-url URL`, `--receipts DEST` (`rabbitmq:<queue>` or `nats:<subject>`),
//! `--lease-ms` [30000], `--every-ms` [500] (the reconciler and the relay), `--prefetch N` [16],
//! and `--crash-at POINT`, where the first event to reach POINT prints `reached POINT` and stops
//! for the process to be killed (`before-order`, `after-order`, `after-charge-call`,
//! `after-charge`, `after-receipt`).

#[allow(dead_code)]
#[path = "support/brokers.rs"]
mod brokers;
#[allow(dead_code)]
#[path = "support/charges_app.rs"]
mod charges_app;
#[allow(dead_code)]
#[path = "support/orders_app.rs"]
mod orders_app;
#[allow(dead_code)]
#[path = "support/receiver.rs"]
mod receiver;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use charges_app::ChargesDb;
use http::HeaderName;
use orders_app::{Crash, Faults, Orders, POINTS};
use safe_retry_server::consumer::{JetStream, RabbitMq};
use safe_retry_server::{IdempotencyLayer, KeySource, Relay};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    RabbitMq,
    Nats,
}

#[derive(Debug, Clone)]
struct Options {
    broker: Broker,
    events: usize,
    database_url: Option<String>,
    consume: bool,
    source: Option<String>,
    dead_letters: Option<String>,
    stream: Option<String>,
    consumer: Option<String>,
    key_header: Option<String>,
    payments: Option<String>,
    receipts: Option<String>,
    lease: Duration,
    every: Duration,
    prefetch: u16,
    crash_at: Option<String>,
}

fn options() -> Result<Options, Error> {
    let mut options = Options {
        broker: Broker::RabbitMq,
        events: 20,
        database_url: None,
        consume: false,
        source: None,
        dead_letters: None,
        stream: None,
        consumer: None,
        key_header: None,
        payments: None,
        receipts: None,
        lease: Duration::from_secs(30),
        every: Duration::from_millis(500),
        prefetch: 16,
        crash_at: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let ms = |v: String| v.parse::<u64>().map(Duration::from_millis);
        match flag.as_str() {
            "--broker" => {
                options.broker = match value()?.as_str() {
                    "rabbitmq" => Broker::RabbitMq,
                    "nats" => Broker::Nats,
                    other => return Err(format!("--broker {other:?}: say rabbitmq or nats").into()),
                }
            }
            "--events" => options.events = value()?.parse()?,
            "--database-url" => options.database_url = Some(value()?),
            "--consume" => options.consume = true,
            "--source" => options.source = Some(value()?),
            "--dead-letters" => options.dead_letters = Some(value()?),
            "--stream" => options.stream = Some(value()?),
            "--consumer" => options.consumer = Some(value()?),
            "--key-header" => options.key_header = Some(value()?),
            "--payments-url" => options.payments = Some(value()?),
            "--receipts" => options.receipts = Some(value()?),
            "--lease-ms" => options.lease = ms(value()?)?,
            "--every-ms" => options.every = ms(value()?)?,
            "--prefetch" => options.prefetch = value()?.parse()?,
            "--crash-at" => {
                let point = value()?;
                if !POINTS.contains(&point.as_str()) {
                    return Err(format!(
                        "--crash-at {point:?} is not a recovery point; the points are {}",
                        POINTS.join(", ")
                    )
                    .into());
                }
                options.crash_at = Some(point);
            }
            other => {
                return Err(format!(
                    "unknown option {other}; the options are --broker, --events, --database-url, \
                     and with --consume: --source, --dead-letters, --stream, --consumer, \
                     --key-header, --payments-url, --receipts, --lease-ms, --every-ms, \
                     --prefetch, --crash-at"
                )
                .into());
            }
        }
    }
    if options.consume {
        let needed = [
            ("--source", options.source.is_some()),
            ("--dead-letters", options.dead_letters.is_some()),
            ("--payments-url", options.payments.is_some()),
            ("--receipts", options.receipts.is_some()),
            ("--database-url", options.database_url.is_some()),
        ];
        if let Some((flag, _)) = needed.iter().find(|(_, given)| !given) {
            return Err(format!("--consume needs {flag}").into());
        }
        if options.broker == Broker::Nats
            && (options.stream.is_none() || options.consumer.is_none())
        {
            return Err("--consume --broker nats needs --stream and --consumer".into());
        }
    }
    Ok(options)
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let options = options()?;
    let (url, own_file) = match &options.database_url {
        Some(url) => (url.clone(), None),
        None => {
            let file =
                std::env::temp_dir().join(format!("safe-retry-events-{}.db", std::process::id()));
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
        Err("a postgres:// database needs the postgres feature: cargo run -p safe-retry-server --features rabbitmq,nats,postgres --example order_events".into())
    } else if url.starts_with("mysql") || url.starts_with("mariadb") {
        #[cfg(feature = "mysql")]
        {
            let store = safe_retry_server::MySqlStore::connect(&url).await?;
            run(store, options).await
        }
        #[cfg(not(feature = "mysql"))]
        Err("a mysql:// database needs the mysql feature: cargo run -p safe-retry-server --features rabbitmq,nats,mysql --example order_events".into())
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

async fn run<S: ChargesDb>(store: S, options: Options) -> Result<(), Error> {
    store.prepare().await?;
    if options.consume {
        return consume(store, options).await;
    }
    demo(store, options).await
}

/// The consumer, its reconciler and its relay, on `options`' broker; the order's faults armed
/// as `--crash-at` says.
async fn start<S: ChargesDb>(
    store: S,
    options: &Options,
    source: &str,
    dead_letters: &str,
) -> Result<
    (
        Vec<tokio::task::JoinHandle<()>>,
        Arc<safe_retry_server::Counters>,
    ),
    Error,
> {
    let mut builder = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .lease(options.lease)
        .in_progress_retry_after(Duration::from_millis(100));
    if let Some(header) = &options.key_header {
        builder = builder.key(KeySource::header(HeaderName::try_from(header.as_str())?));
    }
    let layer = builder.build_consumer()?;
    let counters = layer.counters().clone();
    let faults = Faults::announced();
    if let Some(point) = &options.crash_at {
        faults.arm(point, Crash::Hang);
    }
    let client = orders_app::dependencies(Duration::from_millis(250));
    let handler = orders_app::orders_handler::<S>(Orders {
        client: client.clone(),
        payments: options.payments.clone().unwrap_or_default(),
        receipts: options.receipts.clone().unwrap_or_default(),
        faults: Arc::new(faults),
    });
    let mut tasks = vec![tokio::spawn(
        layer.reconciler(handler.clone()).run(options.every),
    )];
    let relay = Relay::of(store.clone())
        .http(client)
        .lease(Duration::from_secs(2))
        .retry_after(Duration::from_millis(200));
    let consumer = layer.consumer(handler);
    match options.broker {
        Broker::RabbitMq => {
            let connection = brokers::rabbitmq().await;
            let channel = connection.create_channel().await?;
            let adapter = RabbitMq::new(channel, source)
                .dead_letters(dead_letters)
                .prefetch(options.prefetch);
            let relay = relay.rabbitmq(connection.create_channel().await?);
            tasks.push(tokio::spawn(relay.run(options.every)));
            tasks.push(tokio::spawn(async move {
                // The connection lives as long as the consumer.
                let _connection = connection;
                if let Err(error) = adapter.run(consumer).await {
                    eprintln!("the consumer stopped: {error}");
                }
            }));
        }
        Broker::Nats => {
            let context = brokers::nats().await;
            let stream = options.stream.clone().expect("a stream");
            let name = options.consumer.clone().expect("a consumer");
            let pull = context
                .get_stream(&stream)
                .await?
                .get_consumer(&name)
                .await?;
            let adapter = JetStream::new(context.clone(), pull, dead_letters)
                .concurrency(usize::from(options.prefetch));
            tasks.push(tokio::spawn(relay.nats(context).run(options.every)));
            tasks.push(tokio::spawn(async move {
                if let Err(error) = adapter.run(consumer).await {
                    eprintln!("the consumer stopped: {error}");
                }
            }));
        }
    }
    Ok((tasks, counters))
}

/// The consumer alone: the process the tests kill.
async fn consume<S: ChargesDb>(store: S, options: Options) -> Result<(), Error> {
    let source = options.source.clone().expect("checked");
    let dead_letters = options.dead_letters.clone().expect("checked");
    let (_tasks, counters) = start(store, &options, &source, &dead_letters).await?;
    println!("consuming");
    // What this process has done, for a test that kills it to add up.
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c = counters.snapshot();
        println!(
            "counts claims={} takeovers={} completions={} replays={} in_progress={} fenced={}",
            c.claims, c.takeovers, c.completions, c.replays, c.in_progress, c.fenced
        );
    }
}

/// The walk-through: order events published (each event's copies among them, and one id
/// reused with another order), consumed by two consumers, receipts read back.
async fn demo<S: ChargesDb>(store: S, mut options: Options) -> Result<(), Error> {
    let (payments_addr, payments) = receiver::Receiver::start("ch").await;
    options.payments = Some(format!("http://{payments_addr}"));
    let name = brokers::unique("order-events");
    let events = options.events;
    // What goes on the wire: every event, 5 of them again (what a redelivery looks like to a
    // consumer), and one id with another order's payload.
    let mut published: Vec<(String, String)> = (1..=events)
        .map(|n| {
            (
                format!("order-{n}"),
                format!("{{\"order\":{n},\"amount\":{}}}", n * 100),
            )
        })
        .collect();
    let again: Vec<_> = published.iter().take(5).cloned().collect();
    published.extend(again);
    published.push(("order-1".into(), "{\"order\":1,\"amount\":999999}".into()));
    println!(
        "{} order events on {:?} ({events} events, 5 of them twice, and one id reused with another order)",
        published.len(),
        options.broker
    );
    let outcome = match options.broker {
        Broker::RabbitMq => demo_rabbitmq(store.clone(), &options, &name, &published).await,
        Broker::Nats => demo_nats(store.clone(), &options, &name, &published).await,
    }?;
    let rows = store.effects().await?;
    let orders: BTreeSet<_> = rows.iter().map(|r| r.key.clone()).collect();
    let charges = payments.effects().len();
    let receipts: BTreeSet<_> = outcome.receipts.iter().cloned().collect();
    println!(
        "order rows: {} (for {} ids); charges at the provider: {charges}; receipts on the broker: {} ({} distinct ids)",
        rows.len(),
        orders.len(),
        outcome.receipts.len(),
        receipts.len()
    );
    for (id, reason) in &outcome.dead_letters {
        println!("dead letter: {id} ({reason})");
    }
    let once = rows.len() == events
        && orders.len() == events
        && charges == events
        && receipts.len() == events
        && outcome.dead_letters == vec![("order-1".to_owned(), "key-reused".to_owned())];
    println!(
        "{}",
        if once {
            "every event charged exactly once, its receipt published once"
        } else {
            "A PROMISE BROKE"
        }
    );
    if once {
        Ok(())
    } else {
        Err("an event was lost or charged twice".into())
    }
}

struct Outcome {
    /// The receipts' ids, as the broker holds them.
    receipts: Vec<String>,
    /// The dead letters: (id, reason).
    dead_letters: Vec<(String, String)>,
}

/// Polls `done` every 50 ms for at most 30 s.
async fn until(mut done: impl AsyncFnMut() -> bool) -> Result<(), Error> {
    for _ in 0..600 {
        if done().await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err("the events were not all processed within 30 s".into())
}

async fn demo_rabbitmq<S: ChargesDb>(
    store: S,
    options: &Options,
    name: &str,
    published: &[(String, String)],
) -> Result<Outcome, Error> {
    let (source, dead, receipts) = (
        name.to_owned(),
        format!("{name}.dead-letters"),
        format!("{name}.receipts"),
    );
    let connection = brokers::rabbitmq().await;
    let channel = connection.create_channel().await?;
    for queue in [&source, &dead, &receipts] {
        brokers::declare_queue(&channel, queue).await;
    }
    channel.confirm_select(Default::default()).await?;
    let publish = async |(id, payload): &(String, String)| -> Result<(), Error> {
        channel
            .basic_publish(
                "".into(),
                source.as_str().into(),
                Default::default(),
                payload.as_bytes(),
                lapin::BasicProperties::default().with_message_id(id.as_str().into()),
            )
            .await?
            .await?;
        Ok(())
    };
    // The id reused with another order goes last, once the events are in: first come, first
    // served, so it is the one refused (sent among them, it could be taken first by one
    // consumer while the other still holds the original).
    let (reused, events_published) = published.split_last().expect("events");
    for event in events_published {
        publish(event).await?;
    }
    let mut options = options.clone();
    options.receipts = Some(format!("rabbitmq:{receipts}"));
    let mut tasks = Vec::new();
    for _ in 0..2 {
        tasks.extend(start(store.clone(), &options, &source, &dead).await?.0);
    }
    let events = published.len() - 6;
    let (mut got, mut dead_letters) = (Vec::new(), Vec::new());
    let mut reused_sent = false;
    let finished = until(async || {
        got.extend(
            brokers::take_all(&connection, &receipts)
                .await
                .into_iter()
                .filter_map(|r| r.id),
        );
        if got.len() >= events && !reused_sent {
            reused_sent = publish(reused).await.is_ok();
        }
        dead_letters.extend(
            brokers::take_all(&connection, &dead)
                .await
                .into_iter()
                .map(|r| {
                    let reason = r.headers.get("safe-retry-reason").cloned();
                    (r.id.unwrap_or_default(), reason.unwrap_or_default())
                }),
        );
        got.len() >= events && !dead_letters.is_empty()
    })
    .await;
    for task in tasks {
        task.abort();
    }
    brokers::delete_queues(&[&source, &dead, &receipts]).await;
    finished?;
    Ok(Outcome {
        receipts: got,
        dead_letters,
    })
}

async fn demo_nats<S: ChargesDb>(
    store: S,
    options: &Options,
    name: &str,
    published: &[(String, String)],
) -> Result<Outcome, Error> {
    let context = brokers::nats().await;
    let (source, dead, receipts) = (
        format!("{name}.orders"),
        format!("{name}.dead"),
        format!("{name}.receipts"),
    );
    brokers::create_stream(
        &context,
        name,
        vec![source.clone(), dead.clone(), receipts.clone()],
    )
    .await;
    let consumer = format!("{name}-consumer");
    brokers::create_consumer(&context, name, &consumer, &source, Duration::from_secs(5)).await;
    // JetStream would drop a copy under the same `Nats-Msg-Id` within the stream's duplicate
    // window: the copies carry their event id in `event-id`, which the consumer reads.
    let publish = async |n: usize| -> Result<(), Error> {
        let (id, payload) = &published[n];
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("event-id", id.as_str());
        headers.insert("Nats-Msg-Id", format!("{name}-{n}").as_str());
        context
            .publish_with_headers(source.clone(), headers, payload.clone().into())
            .await?
            .await?;
        Ok(())
    };
    // The id reused with another order goes last, once the events are in (as on RabbitMQ).
    let reused = published.len() - 1;
    for n in 0..reused {
        publish(n).await?;
    }
    let mut options = options.clone();
    options.receipts = Some(format!("nats:{receipts}"));
    options.stream = Some(name.to_owned());
    options.consumer = Some(consumer);
    options.key_header = Some("event-id".into());
    let mut tasks = Vec::new();
    for _ in 0..2 {
        tasks.extend(start(store.clone(), &options, &source, &dead).await?.0);
    }
    let events = published.len() - 6;
    let (mut got, mut dead_letters) = (Vec::new(), Vec::new());
    let mut reused_sent = false;
    let finished = until(async || {
        got = brokers::messages_on(&context, name, &receipts)
            .await
            .into_iter()
            .filter_map(|r| r.id)
            .collect();
        if got.len() >= events && !reused_sent {
            reused_sent = publish(reused).await.is_ok();
        }
        dead_letters = brokers::messages_on(&context, name, &dead)
            .await
            .into_iter()
            .map(|r| {
                let field = |n: &str| r.headers.get(n).cloned().unwrap_or_default();
                (field("event-id"), field("safe-retry-reason"))
            })
            .collect();
        got.len() >= events && !dead_letters.is_empty()
    })
    .await;
    for task in tasks {
        task.abort();
    }
    brokers::delete_streams(&context, &[name]).await;
    finished?;
    Ok(Outcome {
        receipts: got,
        dead_letters,
    })
}
