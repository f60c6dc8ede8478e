//! Consumers under chaos, through each broker, on PostgreSQL: 1,000 order events consumed by
//! three `order_events` processes while a seeded schedule kills one (SIGKILL, and starts
//! another in its place) or pauses one (SIGSTOP, then SIGCONT), in turn, every few hundred
//! milliseconds, at whatever point it has reached — mid-handler, after its effect and before
//! its acknowledgement, mid-publish of a receipt. The kills make the brokers deliver again what
//! was not acknowledged (RabbitMQ at once, JetStream after its 1 s ack wait). Then the
//! survivors finish, and the test counts: every event one order row and one charge, every
//! event's receipt on the broker, no dead letter, every event acknowledged.
//!
//! Bounded: the chaos lasts 3 s (longer only until there have been three kills and three
//! pauses), and the finish at most 60 s.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::process::Child;

use crate::charges_app::ChargesDb;
use crate::consumer::{Broker, Line, lines_of, until};
use crate::receiver::Receiver;
use crate::support::Backend;

const EVENTS: usize = 1_000;

/// A consumer process, and the last counts it printed.
struct Consumer {
    child: Child,
    counts: Arc<Mutex<[u64; 6]>>,
}

impl Consumer {
    fn start(line: &Line, url: &str, payments: std::net::SocketAddr) -> Consumer {
        // Eight at a time each.
        let mut child = line.process(url, payments, None, 8);
        let mut lines = lines_of(&mut child);
        let counts = Arc::new(Mutex::new([0; 6]));
        let last = counts.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(rest) = line.strip_prefix("counts ") {
                    let mut read = [0; 6];
                    for (i, field) in rest.split(' ').take(6).enumerate() {
                        read[i] = field
                            .split_once('=')
                            .and_then(|(_, v)| v.parse().ok())
                            .unwrap_or(0);
                    }
                    *last.lock().unwrap() = read;
                }
            }
        });
        Consumer { child, counts }
    }

    fn signal(&self, name: &str) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args([&format!("-{name}"), &pid.to_string()])
                .status();
        }
    }
}

/// xorshift64*: the schedule's draws, the same for a seed.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

async fn consumers_under_chaos(broker: Broker) {
    let started = std::time::Instant::now();
    let (payments_addr, payments) = Receiver::start("ch").await;
    let url = safe_retry_server::PostgresStore::empty_database().await;
    let line = Line::new(broker, Duration::from_secs(1)).await;
    let events: Vec<(String, Vec<u8>)> = (0..EVENTS)
        .map(|n| {
            (
                format!("order-{n:04}"),
                format!("{{\"order\":{n}}}").into_bytes(),
            )
        })
        .collect();
    line.publish_many(&events).await;

    let mut consumers: Vec<Consumer> = (0..3)
        .map(|_| Consumer::start(&line, &url, payments_addr))
        .collect();
    let mut ended_counts = [0u64; 6];
    let (mut kills, mut pauses) = (0, 0);
    let mut receipts: Vec<String> = Vec::new();
    let mut seed = 0x5EED_C0DE_u64;
    // Kills and pauses take turns, on a process the seed picks, for at least 3 s and until
    // there have been three of each.
    let chaos_until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < chaos_until || kills < 3 || pauses < 3 {
        tokio::time::sleep(Duration::from_millis(50 + next(&mut seed) % 150)).await;
        let victim = (next(&mut seed) % consumers.len() as u64) as usize;
        if kills <= pauses {
            let mut dead = std::mem::replace(
                &mut consumers[victim],
                Consumer::start(&line, &url, payments_addr),
            );
            dead.child.kill().await.unwrap();
            let counts = *dead.counts.lock().unwrap();
            for (sum, count) in ended_counts.iter_mut().zip(counts) {
                *sum += count;
            }
            kills += 1;
        } else {
            consumers[victim].signal("STOP");
            tokio::time::sleep(Duration::from_millis(50 + next(&mut seed) % 450)).await;
            consumers[victim].signal("CONT");
            pauses += 1;
        }
        receipts.extend(line.receipts().await);
        let done = receipts.iter().collect::<BTreeSet<_>>().len() >= EVENTS;
        if done && kills >= 3 && pauses >= 3 {
            break;
        }
    }
    let chaos = started.elapsed();

    until(Duration::from_secs(60), "every receipt", async || {
        receipts.extend(line.receipts().await);
        receipts.iter().collect::<BTreeSet<_>>().len() >= EVENTS
    })
    .await;
    until(
        Duration::from_secs(30),
        "every event acknowledged",
        async || line.pending().await == (0, 0),
    )
    .await;
    let mut children = Vec::new();
    for consumer in consumers {
        children.push(consumer.child);
        // A process killed below prints no more: its last counts are final enough.
        let counts = *consumer.counts.lock().unwrap();
        for (sum, count) in ended_counts.iter_mut().zip(counts) {
            *sum += count;
        }
    }
    let (acknowledged, state) = crate::consumer::stop_all(&line, children, || {
        line.process(&url, payments_addr, None, 8)
    })
    .await;
    receipts.extend(line.receipts().await);

    let store = safe_retry_server::PostgresStore::connect_to(&url).await;
    let rows = store.effects().await.unwrap();
    let orders: BTreeSet<_> = rows.iter().map(|r| r.key.as_str()).collect();
    let distinct_receipts: BTreeSet<_> = receipts.iter().collect();
    let dead = line.dead_letters().await;
    let [claims, takeovers, completions, replays, in_progress, fenced] = ended_counts;
    eprintln!(
        "{broker:?} chaos: {EVENTS} events, {kills} kills and {pauses} pauses in {chaos:.1?}, \
         all done in {:.1?}; order rows {} ({} distinct), charges {} (calls {}), receipts {} \
         ({} distinct), dead letters {}; counted by the processes (a killed one's last print): \
         claims {claims}, takeovers {takeovers}, completions {completions}, replays {replays}, \
         in progress {in_progress}, fenced {fenced}; {state}",
        started.elapsed(),
        rows.len(),
        orders.len(),
        payments.effects().len(),
        payments.calls.load(std::sync::atomic::Ordering::SeqCst),
        receipts.len(),
        distinct_receipts.len(),
        dead.len(),
    );
    assert!(
        kills >= 3 && pauses >= 3,
        "the chaos happened: {kills} kills, {pauses} pauses"
    );
    assert_eq!(rows.len(), EVENTS, "no duplicate and no lost order row");
    assert_eq!(orders.len(), EVENTS);
    assert_eq!(payments.effects().len(), EVENTS, "one charge an event");
    assert_eq!(distinct_receipts.len(), EVENTS, "every receipt");
    assert!(dead.is_empty(), "{dead:?}");
    assert!(acknowledged, "every event acknowledged: {state}");
    line.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_consumers_killed_and_paused_make_each_effect_once() {
    consumers_under_chaos(Broker::RabbitMq).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_consumers_killed_and_paused_make_each_effect_once() {
    consumers_under_chaos(Broker::Nats).await
}
