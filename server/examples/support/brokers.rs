//! The brokers on this machine, as the consumer example and its tests reach them: RabbitMQ at
//! `SAFE_RETRY_RABBITMQ_URL` [amqp://guest:guest@127.0.0.1:5672/%2f] and NATS with JetStream at
//! `SAFE_RETRY_NATS_URL` [nats://127.0.0.1:4222], with queues and streams named for each use
//! and removed after it.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};

/// RabbitMQ's address.
pub fn rabbitmq_url() -> String {
    std::env::var("SAFE_RETRY_RABBITMQ_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// NATS's address.
pub fn nats_url() -> String {
    std::env::var("SAFE_RETRY_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A connection to RabbitMQ, or a panic that says how to get one.
pub async fn rabbitmq() -> Connection {
    let url = rabbitmq_url();
    let connecting = Connection::connect(&url, ConnectionProperties::default());
    match tokio::time::timeout(Duration::from_secs(10), connecting).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(error)) => panic!("{}", unreachable_rabbitmq(&url, &error.to_string())),
        Err(_) => panic!("{}", unreachable_rabbitmq(&url, "no answer in 10 s")),
    }
}

fn unreachable_rabbitmq(url: &str, error: &str) -> String {
    format!(
        "RabbitMQ is unreachable at {url} ({error}): these tests need a broker. Start one \
         (`apt-get install rabbitmq-server`, or `docker run -p 5672:5672 rabbitmq:4`) or set \
         SAFE_RETRY_RABBITMQ_URL"
    )
}

/// A JetStream context on NATS, or a panic that says how to get one.
pub async fn nats() -> jetstream::Context {
    let url = nats_url();
    let unreachable = |error: &str| {
        format!(
            "NATS is unreachable at {url} ({error}): these tests need a server with JetStream. \
             Start one (`nats-server -js`, or `docker run -p 4222:4222 nats -js`) or set \
             SAFE_RETRY_NATS_URL"
        )
    };
    let options = async_nats::ConnectOptions::new();
    let connecting = options.connect(url.as_str());
    match tokio::time::timeout(Duration::from_secs(10), connecting).await {
        Ok(Ok(client)) => jetstream::new(client),
        Ok(Err(error)) => panic!("{}", unreachable(&error.to_string())),
        Err(_) => panic!("{}", unreachable("no answer in 10 s")),
    }
}

/// A name no other test or run shares: `safe-retry-<what>-<pid>-<n>`.
pub fn unique(what: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "safe-retry-{what}-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Declares `queue` durable on `channel`.
pub async fn declare_queue(channel: &Channel, queue: &str) {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await
        .expect("RabbitMQ declares the queue");
}

/// Deletes `queues` (what each test made), ignoring those already gone.
pub async fn delete_queues(queues: &[&str]) {
    let connection = rabbitmq().await;
    for queue in queues {
        // A channel per queue: a failed delete closes its channel.
        if let Ok(channel) = connection.create_channel().await {
            let _ = channel
                .queue_delete((*queue).into(), QueueDeleteOptions::default())
                .await;
        }
    }
    let _ = connection.close(200, "done".into()).await;
}

/// Creates the stream `name` capturing `subjects`, with a duplicate window of a minute.
pub async fn create_stream(context: &jetstream::Context, name: &str, subjects: Vec<String>) {
    context
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects,
            duplicate_window: Duration::from_secs(60),
            ..stream::Config::default()
        })
        .await
        .expect("JetStream creates the stream");
}

/// A durable pull consumer `name` on `stream` for `subject`, delivering again after `ack_wait`.
pub async fn create_consumer(
    context: &jetstream::Context,
    stream: &str,
    name: &str,
    subject: &str,
    ack_wait: Duration,
) -> consumer::PullConsumer {
    context
        .get_stream(stream)
        .await
        .expect("the stream exists")
        .create_consumer(consumer::pull::Config {
            durable_name: Some(name.to_owned()),
            filter_subject: subject.to_owned(),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            max_ack_pending: 256,
            ..consumer::pull::Config::default()
        })
        .await
        .expect("JetStream creates the consumer")
}

/// Deletes `streams`, ignoring those already gone.
pub async fn delete_streams(context: &jetstream::Context, streams: &[&str]) {
    for stream in streams {
        let _ = context.delete_stream(stream).await;
    }
}

/// A message read back off a broker: its id, its headers of text, its payload.
#[derive(Debug, Clone)]
pub struct Read {
    pub id: Option<String>,
    /// RabbitMQ's content-type property.
    pub content_type: Option<String>,
    pub headers: std::collections::BTreeMap<String, String>,
    pub payload: Vec<u8>,
}

/// Takes the messages waiting on `queue` (as many as it holds when asked, at most 65,535),
/// through a consumer of its own that holds no more than that and acknowledges what it read.
pub async fn take_all(connection: &Connection, queue: &str) -> Vec<Read> {
    let channel = connection.create_channel().await.expect("a channel");
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let waiting = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .expect("the queue")
        .message_count();
    let waiting = waiting.min(u32::from(u16::MAX)) as u16;
    let mut read = Vec::new();
    if waiting > 0 {
        channel
            .basic_qos(waiting, Default::default())
            .await
            .expect("basic.qos");
        let mut deliveries = channel
            .basic_consume(
                queue.into(),
                "".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .expect("basic.consume");
        while read.len() < usize::from(waiting) {
            let next = tokio::time::timeout(Duration::from_secs(5), next(&mut deliveries)).await;
            let Ok(Some(Ok(delivery))) = next else { break };
            delivery
                .acker
                .ack(Default::default())
                .await
                .expect("basic.ack");
            let properties = &delivery.properties;
            let mut headers = std::collections::BTreeMap::new();
            if let Some(table) = properties.headers() {
                for (name, value) in table {
                    if let lapin::types::AMQPValue::LongString(s) = value {
                        headers.insert(
                            name.to_string(),
                            String::from_utf8_lossy(s.as_bytes()).into_owned(),
                        );
                    }
                }
            }
            read.push(Read {
                id: properties.message_id().as_ref().map(|id| id.to_string()),
                content_type: properties.content_type().as_ref().map(|c| c.to_string()),
                headers,
                payload: delivery.data.clone(),
            });
        }
    }
    let _ = channel.close(200, "read".into()).await;
    read
}

/// Every message `stream` holds on `subject`, in order (read without a consumer).
pub async fn messages_on(context: &jetstream::Context, stream: &str, subject: &str) -> Vec<Read> {
    messages_since(context, stream, subject, 0).await.0
}

/// The messages `stream` holds on `subject` after sequence `after`, and the last sequence read:
/// through a consumer of its own that acknowledges nothing, removed after.
pub async fn messages_since(
    context: &jetstream::Context,
    stream: &str,
    subject: &str,
    after: u64,
) -> (Vec<Read>, u64) {
    let stream = context.get_stream(stream).await.expect("the stream");
    let reader = stream
        .create_consumer(consumer::pull::Config {
            filter_subject: subject.to_owned(),
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: after + 1,
            },
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(10),
            ..consumer::pull::Config::default()
        })
        .await
        .expect("a reading consumer");
    let (mut read, mut last) = (Vec::new(), after);
    loop {
        let mut batch = reader
            .fetch()
            .max_messages(500)
            .messages()
            .await
            .expect("a fetch");
        let mut got = 0;
        while let Some(Ok(message)) = next(&mut batch).await {
            got += 1;
            if let Ok(info) = message.info() {
                last = last.max(info.stream_sequence);
            }
            let mut headers = std::collections::BTreeMap::new();
            if let Some(map) = &message.headers {
                for (name, values) in map.iter() {
                    if let Some(value) = values.first() {
                        headers.insert(name.to_string(), value.as_str().to_owned());
                    }
                }
            }
            read.push(Read {
                id: headers.get("Nats-Msg-Id").cloned(),
                content_type: None,
                headers,
                payload: message.payload.to_vec(),
            });
        }
        if got < 500 {
            break;
        }
    }
    let name = reader.cached_info().name.clone();
    let _ = stream.delete_consumer(&name).await;
    (read, last)
}

/// A stream's next item.
async fn next<St: futures_core::Stream + Unpin>(stream: &mut St) -> Option<St::Item> {
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *stream).poll_next(cx)).await
}
