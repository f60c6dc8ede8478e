//! The consumer front through real brokers, on every store: RabbitMQ (127.0.0.1:5672) and NATS
//! JetStream (127.0.0.1:4222), each test on a queue or a stream of its own, removed after it.
//! Effects are counted in the store's effects table; dead letters are read off the broker.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use safe_retry_server::consumer::{Consumer, ConsumerLayer, JetStream, RabbitMq};
use safe_retry_server::{Execution, IdempotencyLayer, KeySource, SavedBody, StoreError};

use crate::brokers;
use crate::support::Backend;

/// Which broker a test runs through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    RabbitMq,
    Nats,
}

/// Runs each named test, generic over its store and given its broker, once per store and
/// broker.
macro_rules! on_every_store_and_broker {
    ($($name:ident),* $(,)?) => {
        mod sqlite_rabbitmq {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::SqliteStore>(super::Broker::RabbitMq).await
                }
            )*
        }
        mod sqlite_nats {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::SqliteStore>(super::Broker::Nats).await
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod postgres_rabbitmq {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::PostgresStore>(super::Broker::RabbitMq).await
                }
            )*
        }
        #[cfg(feature = "postgres")]
        mod postgres_nats {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::PostgresStore>(super::Broker::Nats).await
                }
            )*
        }
        #[cfg(feature = "mysql")]
        mod mysql_rabbitmq {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::MySqlStore>(super::Broker::RabbitMq).await
                }
            )*
        }
        #[cfg(feature = "mysql")]
        mod mysql_nats {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<safe_retry_server::MySqlStore>(super::Broker::Nats).await
                }
            )*
        }
    };
}

/// A source made for one test on its broker (a queue, or a stream with its subject and a
/// durable consumer), its dead letters, and the consumers running on it. Removed on `close`.
pub struct Line {
    pub broker: Broker,
    /// The queue, or the subject.
    pub source: String,
    pub dead_letters: String,
    /// Where the order handler's receipts go: a queue, or a subject of the line's stream.
    pub receipts: String,
    stream: String,
    consumer_name: String,
    rabbit: Option<lapin::Connection>,
    nats: Option<async_nats::jetstream::Context>,
    running: Vec<Running>,
    removed: bool,
    /// The stream's last sequence `receipts` read (JetStream).
    receipts_read: std::sync::Mutex<u64>,
}

/// A consumer running on a line: how to start it again, its own connection (RabbitMQ), and
/// its task.
struct Running {
    start: Start,
    connection: Option<(lapin::Connection, lapin::Channel)>,
    task: tokio::task::JoinHandle<()>,
}

/// Starts a consumer's adapter: on a RabbitMQ channel, or on the line's JetStream consumer.
type Start =
    std::sync::Arc<dyn Fn(Option<lapin::Channel>) -> tokio::task::JoinHandle<()> + Send + Sync>;

impl Line {
    pub async fn new(broker: Broker, ack_wait: Duration) -> Line {
        let name = brokers::unique("orders");
        let mut line = Line {
            broker,
            source: name.clone(),
            dead_letters: format!("{name}.dead-letters"),
            receipts: format!("{name}.receipts"),
            stream: name.replace('.', "-"),
            consumer_name: format!("{name}-consumer").replace('.', "-"),
            rabbit: None,
            nats: None,
            running: Vec::new(),
            removed: false,
            receipts_read: std::sync::Mutex::new(0),
        };
        match broker {
            Broker::RabbitMq => {
                let connection = brokers::rabbitmq().await;
                let channel = connection.create_channel().await.expect("a channel");
                brokers::declare_queue(&channel, &line.source).await;
                brokers::declare_queue(&channel, &line.dead_letters).await;
                brokers::declare_queue(&channel, &line.receipts).await;
                line.rabbit = Some(connection);
            }
            Broker::Nats => {
                let context = brokers::nats().await;
                line.source = format!("{}.created", line.stream);
                line.dead_letters = format!("{}.dead", line.stream);
                line.receipts = format!("{}.receipts", line.stream);
                brokers::create_stream(
                    &context,
                    &line.stream,
                    vec![
                        line.source.clone(),
                        line.dead_letters.clone(),
                        line.receipts.clone(),
                    ],
                )
                .await;
                brokers::create_consumer(
                    &context,
                    &line.stream,
                    &line.consumer_name,
                    &line.source,
                    ack_wait,
                )
                .await;
                line.nats = Some(context);
            }
        }
        line
    }

    /// Publishes a message with `id` (none when `None`) and `payload`.
    pub async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        match self.broker {
            Broker::RabbitMq => {
                let channel = self.rabbit().create_channel().await.expect("a channel");
                let mut properties = lapin::BasicProperties::default();
                if let Some(id) = id {
                    properties = properties.with_message_id(id.into());
                }
                channel
                    .confirm_select(Default::default())
                    .await
                    .expect("confirm mode");
                channel
                    .basic_publish(
                        "".into(),
                        self.source.as_str().into(),
                        Default::default(),
                        payload,
                        properties,
                    )
                    .await
                    .expect("published")
                    .await
                    .expect("confirmed");
                let _ = channel.close(200, "done".into()).await;
            }
            Broker::Nats => {
                // JetStream drops a publish whose `Nats-Msg-Id` it saw within the stream's
                // duplicate window, so copies of one message (what a publisher that retried
                // without a stable id, or outside the window, makes) carry their id in
                // `order-id`, which the layer on a NATS line reads; each copy's `Nats-Msg-Id`
                // is its own.
                let mut headers = async_nats::HeaderMap::new();
                if let Some(id) = id {
                    headers.insert(ORDER_ID, id);
                }
                headers.insert("Nats-Msg-Id", brokers::unique("copy").as_str());
                self.nats()
                    .publish_with_headers(self.source.clone(), headers, payload.to_vec().into())
                    .await
                    .expect("published")
                    .await
                    .expect("acknowledged");
            }
        }
    }

    /// Publishes a message with `id`, `payload` and the headers `x-tenant` and `x-region` (and
    /// on RabbitMQ an integer `x-count`).
    pub async fn publish_with_headers(&self, id: &str, payload: &[u8]) {
        match self.broker {
            Broker::RabbitMq => {
                use lapin::types::{AMQPValue, FieldTable, LongString};
                let channel = self.rabbit().create_channel().await.expect("a channel");
                let mut headers = FieldTable::default();
                headers.insert(
                    "x-tenant".into(),
                    AMQPValue::LongString(LongString::from(b"t-1".to_vec())),
                );
                headers.insert(
                    "x-region".into(),
                    AMQPValue::LongString(LongString::from(b"eu".to_vec())),
                );
                headers.insert("x-count".into(), AMQPValue::LongInt(3));
                let properties = lapin::BasicProperties::default()
                    .with_message_id(id.into())
                    .with_content_type("application/json".into())
                    .with_headers(headers);
                channel
                    .basic_publish(
                        "".into(),
                        self.source.as_str().into(),
                        Default::default(),
                        payload,
                        properties,
                    )
                    .await
                    .expect("published");
                let _ = channel.close(200, "done".into()).await;
            }
            Broker::Nats => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(ORDER_ID, id);
                headers.insert("x-tenant", "t-1");
                headers.insert("x-region", "eu");
                headers.insert("content-type", "application/json");
                self.nats()
                    .publish_with_headers(self.source.clone(), headers, payload.to_vec().into())
                    .await
                    .expect("published")
                    .await
                    .expect("acknowledged");
            }
        }
    }

    /// Publishes `messages` (id, payload) at once: on one channel with its confirms awaited
    /// together (RabbitMQ), or with JetStream's acknowledgements awaited together.
    pub async fn publish_many(&self, messages: &[(String, Vec<u8>)]) {
        match self.broker {
            Broker::RabbitMq => {
                let channel = self.rabbit().create_channel().await.expect("a channel");
                channel
                    .confirm_select(Default::default())
                    .await
                    .expect("confirm mode");
                let mut confirms = Vec::new();
                for (id, payload) in messages {
                    let properties =
                        lapin::BasicProperties::default().with_message_id(id.as_str().into());
                    confirms.push(
                        channel
                            .basic_publish(
                                "".into(),
                                self.source.as_str().into(),
                                Default::default(),
                                payload,
                                properties,
                            )
                            .await
                            .expect("published"),
                    );
                }
                for confirm in confirms {
                    confirm.await.expect("confirmed");
                }
                let _ = channel.close(200, "done".into()).await;
            }
            Broker::Nats => {
                let mut acks = Vec::new();
                for (id, payload) in messages {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert(ORDER_ID, id.as_str());
                    headers.insert("Nats-Msg-Id", brokers::unique("copy").as_str());
                    acks.push(
                        self.nats()
                            .publish_with_headers(
                                self.source.clone(),
                                headers,
                                payload.clone().into(),
                            )
                            .await
                            .expect("published"),
                    );
                }
                for ack in acks {
                    ack.await.expect("acknowledged");
                }
            }
        }
    }

    fn rabbit(&self) -> &lapin::Connection {
        self.rabbit.as_ref().expect("a RabbitMQ line")
    }

    fn nats(&self) -> &async_nats::jetstream::Context {
        self.nats.as_ref().expect("a NATS line")
    }

    /// Starts a consumer on this line: on a connection of its own (RabbitMQ), or pulling from
    /// the line's durable consumer (JetStream).
    pub async fn consume<Svc, S>(&mut self, consumer: Consumer<Svc, S>)
    where
        Svc: tower_service::Service<http::Request<SavedBody>, Response = Response>
            + Clone
            + Send
            + Sync
            + 'static,
        Svc::Future: Send,
        Svc::Error: Send,
        S: safe_retry_server::Store,
    {
        let start: Start = match self.broker {
            Broker::RabbitMq => {
                let (source, dead) = (self.source.clone(), self.dead_letters.clone());
                std::sync::Arc::new(move |channel: Option<lapin::Channel>| {
                    let adapter = RabbitMq::new(channel.expect("a channel"), source.clone())
                        .dead_letters(dead.clone());
                    let consumer = consumer.clone();
                    tokio::spawn(async move {
                        let _ = adapter.run(consumer).await;
                    })
                })
            }
            Broker::Nats => {
                let context = self.nats().clone();
                let pull = context
                    .get_stream(&self.stream)
                    .await
                    .expect("the stream")
                    .get_consumer(&self.consumer_name)
                    .await
                    .expect("the consumer");
                let dead = self.dead_letters.clone();
                std::sync::Arc::new(move |_| {
                    let adapter = JetStream::new(context.clone(), pull.clone(), dead.clone());
                    let consumer = consumer.clone();
                    tokio::spawn(async move {
                        let _ = adapter.run(consumer).await;
                    })
                })
            }
        };
        let running = self.start(start).await;
        self.running.push(running);
    }

    async fn start(&self, start: Start) -> Running {
        match self.broker {
            Broker::RabbitMq => {
                let connection = brokers::rabbitmq().await;
                let channel = connection.create_channel().await.expect("a channel");
                let task = start(Some(channel.clone()));
                Running {
                    start,
                    connection: Some((connection, channel)),
                    task,
                }
            }
            Broker::Nats => Running {
                task: start(None),
                start,
                connection: None,
            },
        }
    }

    /// Waits (at most `within`) until every message published has been acknowledged, and
    /// stops the consumers. RabbitMQ does not report unacknowledged deliveries over AMQP: once
    /// its queue is empty, the consumers' connections are closed (what they had not
    /// acknowledged goes back to the queue), and if anything came back they start again.
    pub async fn settle(&mut self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let (ready, unacked) = self.pending().await;
            assert!(
                tokio::time::Instant::now() < deadline,
                "{ready} messages not delivered, {unacked} not acknowledged after {within:?}"
            );
            if ready > 0 || unacked > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            let running = std::mem::take(&mut self.running);
            let mut starts = Vec::new();
            for consumer in running {
                consumer.task.abort();
                if let Some((connection, channel)) = consumer.connection {
                    // The broker takes back what the channel held unacknowledged before it
                    // confirms the channel's close.
                    let _ = channel.close(200, "settled".into()).await;
                    let _ = connection.close(200, "settled".into()).await;
                }
                let _ = consumer.task.await;
                starts.push(consumer.start);
            }
            if self.broker == Broker::Nats || self.pending().await == (0, 0) {
                return;
            }
            for start in starts {
                let running = self.start(start).await;
                self.running.push(running);
            }
        }
    }

    /// Messages waiting, and messages delivered but not acknowledged.
    pub async fn pending(&self) -> (u64, u64) {
        match self.broker {
            Broker::RabbitMq => {
                let channel = self.rabbit().create_channel().await.expect("a channel");
                let passive = lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                let queue = channel
                    .queue_declare(self.source.as_str().into(), passive, Default::default())
                    .await
                    .expect("the queue");
                let _ = channel.close(200, "done".into()).await;
                // Deliveries a consumer holds unacknowledged are not counted: `settle` closes
                // the consumers to see them.
                (u64::from(queue.message_count()), 0)
            }
            Broker::Nats => {
                let mut consumer: async_nats::jetstream::consumer::PullConsumer = self
                    .nats()
                    .get_stream(&self.stream)
                    .await
                    .expect("the stream")
                    .get_consumer(&self.consumer_name)
                    .await
                    .expect("the consumer");
                let info = consumer.info().await.expect("the consumer's info");
                (info.num_pending, info.num_ack_pending as u64)
            }
        }
    }

    /// The ids of the receipts that came since the last call, repeats included.
    pub async fn receipts(&self) -> Vec<String> {
        let read = match self.broker {
            Broker::RabbitMq => brokers::take_all(self.rabbit(), &self.receipts).await,
            Broker::Nats => {
                let after = *self.receipts_read.lock().unwrap();
                let (read, last) =
                    brokers::messages_since(self.nats(), &self.stream, &self.receipts, after).await;
                *self.receipts_read.lock().unwrap() = last;
                read
            }
        };
        read.into_iter().filter_map(|r| r.id).collect()
    }

    /// The `order_events` example consuming this line as a process of its own, on the
    /// database at `url`, charging at `payments`; stopped at `crash` when given.
    pub fn process(
        &self,
        url: &str,
        payments: std::net::SocketAddr,
        crash: Option<&str>,
        prefetch: u16,
    ) -> tokio::process::Child {
        let broker = match self.broker {
            Broker::RabbitMq => "rabbitmq",
            Broker::Nats => "nats",
        };
        let receipts = format!("{broker}:{}", self.receipts);
        let mut command = tokio::process::Command::new(
            crate::walkthrough::example_binary().with_file_name("order_events"),
        );
        command
            .args(["--consume", "--broker", broker, "--database-url", url])
            .args([
                "--source",
                &self.source,
                "--dead-letters",
                &self.dead_letters,
            ])
            .args(["--payments-url", &format!("http://{payments}")])
            .args(["--receipts", &receipts])
            .args(["--lease-ms", "500", "--every-ms", "100"])
            .args(["--prefetch", &prefetch.to_string()])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        if self.broker == Broker::Nats {
            command
                .args(["--stream", &self.stream, "--consumer", &self.consumer_name])
                .args(["--key-header", ORDER_ID]);
        }
        if let Some(point) = crash {
            command.args(["--crash-at", point]);
        }
        command
            .spawn()
            .expect("the order_events example is built beside the tests")
    }

    /// Whether every message is acknowledged, once no consumer runs: JetStream reports what
    /// is pending and unacknowledged; RabbitMQ takes a dead consumer's unacknowledged
    /// deliveries back before it drops the consumer, so once the queue has no consumer its
    /// count is all that was not acknowledged.
    pub async fn all_acknowledged(&self) -> (bool, String) {
        match self.broker {
            Broker::Nats => {
                let (pending, unacked) = self.pending().await;
                (
                    pending == 0 && unacked == 0,
                    format!("{pending} pending, {unacked} unacknowledged"),
                )
            }
            Broker::RabbitMq => {
                let channel = self.rabbit().create_channel().await.expect("a channel");
                let passive = lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                };
                let mut last = String::new();
                for _ in 0..200 {
                    let queue = channel
                        .queue_declare(self.source.as_str().into(), passive, Default::default())
                        .await
                        .expect("the queue");
                    last = format!(
                        "{} messages, {} consumers",
                        queue.message_count(),
                        queue.consumer_count()
                    );
                    if queue.consumer_count() == 0 {
                        let _ = channel.close(200, "done".into()).await;
                        return (queue.message_count() == 0, last);
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                (
                    false,
                    format!("the consumers did not go within 5 s: {last}"),
                )
            }
        }
    }

    /// The dead letters: (message id, reason), in the order they came. On a NATS line the id
    /// is the copy's `order-id`.
    pub async fn dead_letters(&self) -> Vec<(String, String)> {
        self.dead_letters_read()
            .await
            .into_iter()
            .map(|(id, reason, _, _)| (id, reason))
            .collect()
    }

    /// The dead letters: (message id, reason, detail, where it came from).
    pub async fn dead_letters_read(&self) -> Vec<(String, String, String, String)> {
        let read = match self.broker {
            Broker::RabbitMq => brokers::take_all(self.rabbit(), &self.dead_letters).await,
            Broker::Nats => {
                brokers::messages_on(self.nats(), &self.stream, &self.dead_letters).await
            }
        };
        let field =
            |r: &brokers::Read, name: &str| r.headers.get(name).cloned().unwrap_or_default();
        read.iter()
            .map(|r| {
                let id = match self.broker {
                    Broker::RabbitMq => r.id.clone().unwrap_or_default(),
                    Broker::Nats => field(r, ORDER_ID),
                };
                let from = match self.broker {
                    Broker::RabbitMq => field(r, "safe-retry-queue"),
                    Broker::Nats => field(r, "safe-retry-subject"),
                };
                (
                    id,
                    field(r, "safe-retry-reason"),
                    field(r, "safe-retry-detail"),
                    from,
                )
            })
            .collect()
    }

    /// Removes what the test made.
    pub async fn close(mut self) {
        self.remove().await;
    }

    async fn remove(&mut self) {
        for consumer in self.running.drain(..) {
            consumer.task.abort();
            if let Some((connection, _)) = consumer.connection {
                let _ = connection.close(200, "closed".into()).await;
            }
        }
        match self.broker {
            Broker::RabbitMq => {
                brokers::delete_queues(&[&self.source, &self.dead_letters, &self.receipts]).await;
            }
            Broker::Nats => brokers::delete_streams(self.nats(), &[&self.stream]).await,
        }
        self.removed = true;
    }
}

impl Drop for Line {
    /// A test that failed before `close` still removes its queues or stream.
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        let (broker, source, dead, receipts, stream) = (
            self.broker,
            self.source.clone(),
            self.dead_letters.clone(),
            self.receipts.clone(),
            self.stream.clone(),
        );
        let removing = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                match broker {
                    Broker::RabbitMq => brokers::delete_queues(&[&source, &dead, &receipts]).await,
                    Broker::Nats => {
                        brokers::delete_streams(&brokers::nats().await, &[&stream]).await
                    }
                }
            });
        });
        let _ = removing.join();
    }
}

/// The handler of the seed's tests: one effect row, written in the transaction that stores
/// the outcome.
async fn effect<S: crate::charges_app::ChargesDb>(
    Extension(execution): Extension<Execution<S>>,
    body: String,
) -> Response {
    let mut tx = match execution.local().await {
        Ok(tx) => tx,
        Err(error) => return error.into_response(),
    };
    match S::record_effect(&mut tx, execution.key(), &body).await {
        Ok(id) => (StatusCode::OK, id.to_string()).into_response(),
        Err(error) => StoreError::from(error).into_response(),
    }
}

/// The header a NATS line's copies carry their id in (see [`Line::publish`]).
const ORDER_ID: &str = "order-id";

fn layer<S: Backend>(store: S, broker: Broker) -> ConsumerLayer<S> {
    let mut builder = IdempotencyLayer::builder(store).shared_scope();
    if broker == Broker::Nats {
        builder = builder.key(KeySource::header(http::HeaderName::from_static(ORDER_ID)));
    }
    builder
        .in_progress_retry_after(Duration::from_millis(50))
        .build_consumer()
        .expect("a valid consumer layer")
}

fn handler<S: Backend>() -> Router {
    Router::new().fallback(post(effect::<S>))
}

/// Effects per key.
async fn effects<S: Backend>(store: &S) -> BTreeMap<String, Vec<String>> {
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for effect in store.effects().await.expect("the effects") {
        by_key.entry(effect.key).or_default().push(effect.body);
    }
    by_key
}

/// One message delivered twice (published twice with one id: what a redelivery after a lost
/// acknowledgement looks like to the consumer) makes one effect, and both are acknowledged.
async fn the_same_message_twice_makes_one_effect<S: Backend>(broker: Broker) {
    let store = S::fresh().await;
    let layer = layer(store.clone(), broker);
    let mut line = Line::new(broker, Duration::from_secs(5)).await;
    line.publish(Some("order-1"), b"{\"amount\":1000}").await;
    line.consume(layer.consumer(handler::<S>())).await;
    line.settle(Duration::from_secs(10)).await;
    // The copy, after the first is done: a redelivery of a message processed before.
    line.consume(layer.consumer(handler::<S>())).await;
    line.publish(Some("order-1"), b"{\"amount\":1000}").await;
    line.settle(Duration::from_secs(10)).await;
    let effects = effects(&store).await;
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(effects["order-1"], vec!["{\"amount\":1000}".to_owned()]);
    let counts = layer.counters().snapshot();
    // A copy taken back from a stopped consumer after its outcome committed is replayed
    // too: one replay at least. One record, run once, unless `settle` stopped a consumer
    // mid-message (RabbitMQ does not say what a consumer holds unacknowledged): then its
    // lease ended at once (counted abandoned, whether its handler had begun or its claim was
    // still on its way) and the message's redelivery took the record over. A consumer
    // stopped while its completion was committing leaves the outcome stored (one effect, the
    // copies replayed) but no completion counted: its lease is counted abandoned instead
    // (seen once in a loaded run: claims 1, completions 0, abandoned 1, replays 3).
    assert!(counts.completions <= 1, "{counts:?}");
    assert!(counts.completions + counts.abandoned >= 1, "{counts:?}");
    assert!(counts.claims <= 1 + counts.abandoned, "{counts:?}");
    assert!(counts.takeovers <= counts.abandoned, "{counts:?}");
    assert!(counts.replays >= 1, "{counts:?}");
    assert!(line.dead_letters().await.is_empty());
    line.close().await;
}

/// 32 copies of one message delivered at once to four consumers make one effect; every copy
/// is acknowledged, none dead-lettered.
async fn thirty_two_copies_at_once_to_four_consumers_make_one_effect<S: Backend>(broker: Broker) {
    let store = S::fresh().await;
    let layer = layer(store.clone(), broker);
    let mut line = Line::new(broker, Duration::from_secs(5)).await;
    for _ in 0..32 {
        line.publish(Some("order-32"), b"{\"amount\":32}").await;
    }
    for _ in 0..4 {
        line.consume(layer.consumer(handler::<S>())).await;
    }
    line.settle(Duration::from_secs(20)).await;
    let effects = effects(&store).await;
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_eq!(effects["order-32"].len(), 1);
    let counts = layer.counters().snapshot();
    // One completion counted, unless a consumer was stopped while it committed; one run,
    // unless `settle` stopped a consumer mid-message (both above).
    assert!(counts.completions <= 1, "{counts:?}");
    assert!(counts.completions + counts.abandoned >= 1, "{counts:?}");
    assert!(counts.claims <= 1 + counts.abandoned, "one run: {counts:?}");
    assert!(counts.takeovers <= counts.abandoned, "{counts:?}");
    assert!(line.dead_letters().await.is_empty());
    line.close().await;
}

/// The same id with another payload is refused to the dead letters with `key-reused`, and
/// makes no effect; a message without an id goes there too, with `missing-key`.
async fn the_same_id_with_another_payload_goes_to_the_dead_letters<S: Backend>(broker: Broker) {
    let store = S::fresh().await;
    let layer = layer(store.clone(), broker);
    let mut line = Line::new(broker, Duration::from_secs(5)).await;
    line.consume(layer.consumer(handler::<S>())).await;
    line.publish(Some("order-7"), b"{\"amount\":7}").await;
    line.settle(Duration::from_secs(10)).await;
    line.consume(layer.consumer(handler::<S>())).await;
    line.publish(Some("order-7"), b"{\"amount\":7000}").await;
    line.publish(None, b"{\"amount\":1}").await;
    line.settle(Duration::from_secs(10)).await;
    let effects = effects(&store).await;
    assert_eq!(
        effects.into_iter().collect::<Vec<_>>(),
        vec![("order-7".to_owned(), vec!["{\"amount\":7}".to_owned()])]
    );
    // A message dead-lettered and then taken back from a stopped consumer before its
    // acknowledgement is dead-lettered again under the same id (JetStream drops the repeat):
    // the dead letters are read as a set.
    let read = line.dead_letters_read().await;
    for (id, reason, detail, from) in &read {
        assert_eq!(from, &line.source, "{id}: where it came from");
        let expected = match reason.as_str() {
            "key-reused" => "this idempotency key was used with another request",
            _ => "this route requires an idempotency key",
        };
        assert!(detail.starts_with(expected), "{id} {reason}: {detail}");
    }
    let mut dead: Vec<_> = read
        .into_iter()
        .map(|(id, reason, _, _)| (id, reason))
        .collect();
    dead.sort();
    dead.dedup();
    assert_eq!(
        dead,
        vec![
            (String::new(), "missing-key".to_owned()),
            ("order-7".to_owned(), "key-reused".to_owned()),
        ]
    );
    line.close().await;
}

/// A message's headers reach its handler as HTTP headers (RabbitMQ's strings; a header of
/// another type is left out), and its id in `safe-retry-message-id`.
async fn a_message_s_headers_reach_its_handler<S: Backend>(broker: Broker) {
    let store = S::fresh().await;
    let layer = layer(store.clone(), broker);
    let handler = Router::new().fallback(post(
        move |Extension(execution): Extension<Execution<S>>, headers: axum::http::HeaderMap| async move {
            let seen = ["x-tenant", "x-region", "x-count", "content-type", "safe-retry-message-id"]
                .map(|name| headers.get(name).map_or("-", |v| v.to_str().unwrap_or("?")))
                .join("|");
            effect::<S>(Extension(execution), seen).await
        },
    ));
    let mut line = Line::new(broker, Duration::from_secs(5)).await;
    line.consume(layer.consumer(handler)).await;
    line.publish_with_headers("order-h", b"{}").await;
    line.settle(Duration::from_secs(10)).await;
    let id = "order-h";
    let effects = effects(&store).await;
    let seen = &effects["order-h"][0];
    if broker == Broker::RabbitMq {
        assert_eq!(seen, &format!("t-1|eu|-|application/json|{id}"));
    } else {
        assert_eq!(
            seen, "t-1|eu|-|application/json|-",
            "no Nats-Msg-Id was set: no message id"
        );
    }
    line.close().await;
}

/// A message whose first run did not finish (the handler answered `Unfinished`, as a step
/// whose dependency is down does) is delivered again after the layer's wait, while its
/// consumer keeps running, and finishes: one effect.
async fn a_message_that_did_not_finish_is_delivered_again_and_finishes<S: Backend>(broker: Broker) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let store = S::fresh().await;
    let layer = layer(store.clone(), broker);
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        Router::new().fallback(post(
            move |Extension(execution): Extension<Execution<S>>, body: String| {
                let runs = runs.clone();
                async move {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        let mut answer = (StatusCode::SERVICE_UNAVAILABLE, "later").into_response();
                        answer
                            .extensions_mut()
                            .insert(safe_retry_server::Unfinished);
                        return answer;
                    }
                    effect::<S>(Extension(execution), body).await
                }
            },
        ))
    };
    let mut line = Line::new(broker, Duration::from_secs(30)).await;
    line.consume(layer.consumer(handler)).await;
    line.publish(Some("order-later"), b"{\"amount\":5}").await;
    until(
        Duration::from_secs(10),
        "the second run's effect",
        async || !effects(&store).await.is_empty(),
    )
    .await;
    line.settle(Duration::from_secs(10)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(effects(&store).await["order-later"].len(), 1);
    let counts = layer.counters().snapshot();
    assert_eq!(
        (counts.unfinished, counts.completions),
        (1, 1),
        "{counts:?}"
    );
    line.close().await;
}

/// The outbox to the broker across relays dropped mid-publish: 200 staged messages, a relay's
/// tick dropped at a random moment eight times (a publish may have reached the broker, its
/// settlement not written: what a killed relay leaves), then relays run until every message is
/// sent. Each message is on the broker; every copy of one carries its one id and its one
/// payload (a republish is the same message, never another); JetStream's duplicate window
/// drops the republishes, so there each is there once.
async fn the_outbox_publishes_each_message_under_one_id_across_relays_dropped_mid_publish<
    S: Backend,
>(
    broker: Broker,
) {
    use safe_retry_server::Relay;
    use safe_retry_server::store::StagedMessage;
    let store = S::fresh().await;
    let line = Line::new(broker, Duration::from_secs(5)).await;
    let url = match broker {
        Broker::RabbitMq => format!("rabbitmq:/{}", line.receipts),
        Broker::Nats => format!("nats:{}", line.receipts),
    };
    let count = 200;
    let headers = [
        (
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        ),
        (
            http::HeaderName::from_static("x-trace"),
            http::HeaderValue::from_static("t-1"),
        ),
    ];
    let mut tx = store.begin().await.unwrap();
    for n in 0..count {
        let body = format!("receipt {n}");
        let message = StagedMessage {
            id: &format!("m-{n:03}"),
            method: "PUBLISH",
            url: &url,
            headers: &headers,
            body: body.as_bytes(),
        };
        store.stage(&mut tx, &message).await.unwrap();
    }
    // And one for a destination nothing takes: a queue that does not exist (RabbitMQ returns
    // the message, published mandatory), a subject no stream captures (JetStream answers no
    // one): never sent, tried again.
    let nowhere = match broker {
        Broker::RabbitMq => format!("rabbitmq:/{}", brokers::unique("no-queue")),
        Broker::Nats => format!("nats:{}", brokers::unique("no-stream")),
    };
    let lost = StagedMessage {
        id: "nowhere",
        method: "PUBLISH",
        url: &nowhere,
        headers: &[],
        body: b"",
    };
    store.stage(&mut tx, &lost).await.unwrap();
    S::commit(tx).await;
    let relay = {
        let relay = Relay::of(store.clone())
            .batch(50)
            .lease(Duration::from_millis(300))
            .retry_after(Duration::from_millis(10));
        match broker {
            Broker::RabbitMq => relay.rabbitmq(line.rabbit().create_channel().await.unwrap()),
            Broker::Nats => relay.nats(line.nats().clone()),
        }
    };
    let mut seed = 0xD0_0D_u64;
    for _ in 0..8 {
        let ticking = tokio::spawn({
            let relay = relay.clone();
            async move { relay.tick().await }
        });
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        tokio::time::sleep(Duration::from_millis((seed >> 33) % 15)).await;
        ticking.abort();
        let _ = ticking.await;
    }
    until(Duration::from_secs(20), "every message sent", async || {
        let _ = relay.tick().await;
        let rows = store.outbox().await.unwrap();
        let sent = rows
            .iter()
            .filter(|(_, status, _)| status == "sent")
            .count();
        sent >= count
    })
    .await;
    let rows = store.outbox().await.unwrap();
    let nowhere = rows.iter().find(|(id, _, _)| id == "nowhere").unwrap();
    assert_eq!(
        nowhere.1, "pending",
        "a message nothing takes is not sent: {nowhere:?}"
    );
    assert!(nowhere.2 >= 1, "{nowhere:?}");
    let read = match broker {
        Broker::RabbitMq => brokers::take_all(line.rabbit(), &line.receipts).await,
        Broker::Nats => brokers::messages_on(line.nats(), &line.stream, &line.receipts).await,
    };
    let mut by_id: BTreeMap<String, std::collections::BTreeSet<Vec<u8>>> = BTreeMap::new();
    for message in &read {
        assert_eq!(
            message.headers.get("x-trace").map(String::as_str),
            Some("t-1")
        );
        match broker {
            Broker::RabbitMq => {
                assert_eq!(message.content_type.as_deref(), Some("application/json"));
                assert!(!message.headers.contains_key("content-type"));
            }
            Broker::Nats => assert_eq!(
                message.headers.get("content-type").map(String::as_str),
                Some("application/json")
            ),
        }
        let id = message.id.clone().expect("every message carries its id");
        by_id.entry(id).or_default().insert(message.payload.clone());
    }
    assert_eq!(by_id.len(), count, "each message on the broker");
    for (id, payloads) in &by_id {
        let n: usize = id[2..].parse().unwrap();
        assert_eq!(
            payloads.iter().collect::<Vec<_>>(),
            vec![&format!("receipt {n}").into_bytes()],
            "{id}: one message, never another"
        );
    }
    if broker == Broker::Nats {
        assert_eq!(
            read.len(),
            count,
            "the duplicate window dropped every republish"
        );
    }
    line.close().await;
}

on_every_store_and_broker!(
    the_same_message_twice_makes_one_effect,
    thirty_two_copies_at_once_to_four_consumers_make_one_effect,
    the_same_id_with_another_payload_goes_to_the_dead_letters,
    a_consumer_killed_after_the_charge_call_leaves_one_charge,
    the_outbox_publishes_each_message_under_one_id_across_relays_dropped_mid_publish,
    a_message_that_did_not_finish_is_delivered_again_and_finishes,
    a_message_s_headers_reach_its_handler,
);

/// Stops `processes` and says whether every message is acknowledged. A RabbitMQ delivery a
/// stopped process had not acknowledged yet (one waiting out its retry while the reconciler
/// finished its record) goes back to the queue: then a new process from `spawn` takes it (a
/// replay, acknowledged without its effect) and is stopped in turn, at most five times.
pub async fn stop_all(
    line: &Line,
    processes: Vec<tokio::process::Child>,
    spawn: impl Fn() -> tokio::process::Child,
) -> (bool, String) {
    let mut processes = processes;
    let mut last = (false, String::new());
    for _ in 0..5 {
        for mut process in processes.drain(..) {
            process.kill().await.unwrap();
        }
        last = line.all_acknowledged().await;
        if last.0 {
            return last;
        }
        processes.push(spawn());
        until(Duration::from_secs(10), "the queue taken", async || {
            line.pending().await == (0, 0)
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    last
}

pub type Lines = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;

pub fn lines_of(child: &mut tokio::process::Child) -> Lines {
    tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
        child.stdout.take().expect("a piped stdout"),
    ))
}

/// Reads the process's lines (for at most 20 s) until one is `line`.
pub async fn until_line(lines: &mut Lines, line: &str) {
    let reading = async {
        while let Some(read) = lines.next_line().await.expect("the process's output") {
            if read == line {
                return;
            }
        }
        panic!("the process ended before it printed {line:?}");
    };
    tokio::time::timeout(Duration::from_secs(20), reading)
        .await
        .unwrap_or_else(|_| panic!("no {line:?} within 20 s"));
}

/// Polls `done` every 25 ms for at most `within`.
pub async fn until<F: AsyncFnMut() -> bool>(within: Duration, what: &str, mut done: F) {
    let deadline = tokio::time::Instant::now() + within;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Crash recovery by a real kill: the consumer (the `order_events` example) killed with
/// SIGKILL once an event's charge reached the provider and before its step committed, the
/// event unacknowledged; a new process takes the redelivered event over once the dead
/// holder's lease (500 ms) has passed, resumes it at the charge step (which the provider
/// answers from its record of the key), and publishes the receipt. One charge, one order row,
/// one receipt, the event acknowledged.
async fn a_consumer_killed_after_the_charge_call_leaves_one_charge<S: Backend>(broker: Broker) {
    let (payments_addr, payments) = crate::receiver::Receiver::start("ch").await;
    let url = S::empty_database().await;
    let line = Line::new(broker, Duration::from_secs(1)).await;
    line.publish(Some("order-kill"), b"{\"amount\":1000}").await;

    let mut first = line.process(&url, payments_addr, Some("after-charge-call"), 16);
    let mut lines = lines_of(&mut first);
    until_line(&mut lines, "reached after-charge-call").await;
    first.kill().await.unwrap();
    assert_eq!(payments.effects().len(), 1, "charged before the kill");

    let second = line.process(&url, payments_addr, None, 16);
    let mut receipts = Vec::new();
    until(Duration::from_secs(20), "the receipt", async || {
        receipts.extend(line.receipts().await);
        !receipts.is_empty()
    })
    .await;
    let store = S::connect_to(&url).await;
    until(
        Duration::from_secs(10),
        "the event acknowledged",
        async || line.pending().await == (0, 0),
    )
    .await;
    let (acknowledged, counts) = stop_all(&line, vec![second], || {
        line.process(&url, payments_addr, None, 16)
    })
    .await;
    assert!(acknowledged, "{counts}");
    receipts.extend(line.receipts().await);
    receipts.sort();
    receipts.dedup();
    assert_eq!(receipts.len(), 1, "one receipt: {receipts:?}");
    assert_eq!(payments.effects().len(), 1, "one charge");
    assert_eq!(
        payments.calls.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "charged again under its key after the kill"
    );
    let rows = store.effects().await.unwrap();
    assert_eq!(rows.len(), 1, "one order row: {rows:?}");
    assert_eq!(rows[0].key, "order-kill");
    assert!(line.dead_letters().await.is_empty());
    line.close().await;
}

/// Publishes to RabbitMQ that the broker returns (no queue bound) and publishes it takes, on
/// one channel at once: each message's own confirmation decides it, never another's return.
async fn rabbitmq_returns_belong_to_their_own_message<S: Backend>() {
    use safe_retry_server::Relay;
    use safe_retry_server::store::StagedMessage;
    let store = S::fresh().await;
    let line = Line::new(Broker::RabbitMq, Duration::from_secs(5)).await;
    let taken = format!("rabbitmq:/{}", line.receipts);
    let nowhere = format!("rabbitmq:/{}", brokers::unique("no-queue"));
    let count: usize = 120;
    let mut tx = store.begin().await.unwrap();
    for n in 0..count {
        let body = format!("receipt {n}");
        let message = StagedMessage {
            id: &format!("m-{n:03}"),
            method: "PUBLISH",
            url: if n.is_multiple_of(3) {
                &nowhere
            } else {
                &taken
            },
            headers: &[],
            body: body.as_bytes(),
        };
        store.stage(&mut tx, &message).await.unwrap();
    }
    S::commit(tx).await;
    let relay = Relay::of(store.clone())
        .batch(count as u32)
        .rabbitmq(line.rabbit().create_channel().await.unwrap());
    for _ in 0..3 {
        relay.tick().await.unwrap();
    }
    let rows = store.outbox().await.unwrap();
    let wrong: Vec<_> = rows
        .iter()
        .filter(|(id, status, _)| {
            let n: usize = id[2..].parse().unwrap();
            let expected = if n.is_multiple_of(3) {
                "pending"
            } else {
                "sent"
            };
            status != expected
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "settled by another message's return: {wrong:?}"
    );
    let read = brokers::take_all(line.rabbit(), &line.receipts).await;
    let ids: std::collections::BTreeSet<_> = read.iter().filter_map(|m| m.id.clone()).collect();
    assert_eq!(
        ids.len(),
        count - count / 3,
        "each routable message on the queue"
    );
    line.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_returns_belong_to_their_own_message_on_sqlite() {
    rabbitmq_returns_belong_to_their_own_message::<safe_retry_server::SqliteStore>().await
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_returns_belong_to_their_own_message_on_postgres() {
    rabbitmq_returns_belong_to_their_own_message::<safe_retry_server::PostgresStore>().await
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_returns_belong_to_their_own_message_on_mysql() {
    rabbitmq_returns_belong_to_their_own_message::<safe_retry_server::MySqlStore>().await
}
