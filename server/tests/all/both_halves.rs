//! Both halves together: this workspace's client sends keyed POSTs to the charges example
//! through a link that resets connections and drops answers at random (seeded), and every
//! charge happens exactly once.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{Dependency, RetryBudget, RetryMiddleware, RetryPolicy, RetryRecord};
use safe_retry_server::IdempotencyLayer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::{Backend, Running};

/// What the link does to one connection (the client opens one per attempt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Resets the connection once the request arrived, before the server sees it.
    ResetBefore,
    /// Passes the request, then resets the connection when the answer starts to come back:
    /// the server did the work, the client never hears of it.
    DropAnswer,
    /// Passes the request, then resets the connection after a few milliseconds, whatever the
    /// server is doing by then.
    CutSoon,
    /// Passes everything.
    Pass,
}

/// A TCP link on loopback between the client and the server that misbehaves by a seeded
/// draw per connection.
struct LossyLink {
    addr: SocketAddr,
    fates: Arc<Mutex<Vec<Fate>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for LossyLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// xorshift64*: a small seeded generator, so a failing seed replays the same link.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

impl LossyLink {
    async fn start(upstream: SocketAddr, seed: u64) -> LossyLink {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fates = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let fates = fates.clone();
            async move {
                let mut state = seed | 1;
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    let fate = match next(&mut state) % 10 {
                        0 | 1 => Fate::ResetBefore,
                        2 | 3 => Fate::DropAnswer,
                        4 => Fate::CutSoon,
                        _ => Fate::Pass,
                    };
                    let cut_after = Duration::from_millis(next(&mut state) % 30);
                    fates.lock().unwrap().push(fate);
                    tokio::spawn(carry(client, upstream, fate, cut_after));
                }
            }
        });
        LossyLink { addr, fates, task }
    }
}

async fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

async fn carry(mut client: TcpStream, upstream: SocketAddr, fate: Fate, cut_after: Duration) {
    let mut first = vec![0u8; 64 * 1024];
    let Ok(n) = client.read(&mut first).await else {
        return;
    };
    if n == 0 {
        return;
    }
    if fate == Fate::ResetBefore {
        return reset(client).await;
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    if server.write_all(&first[..n]).await.is_err() {
        return;
    }
    match fate {
        Fate::DropAnswer => {
            // Carry the rest of the request; reset both sides at the answer's first byte.
            let mut buf = vec![0u8; 64 * 1024];
            let mut answer = [0u8; 1];
            loop {
                tokio::select! {
                    read = client.read(&mut buf) => match read {
                        Ok(0) | Err(_) => return,
                        Ok(n) => if server.write_all(&buf[..n]).await.is_err() { return },
                    },
                    read = server.read(&mut answer) => {
                        let _ = read;
                        reset(server).await;
                        return reset(client).await;
                    }
                }
            }
        }
        Fate::CutSoon => {
            let _ = tokio::time::timeout(
                cut_after,
                tokio::io::copy_bidirectional(&mut client, &mut server),
            )
            .await;
            reset(server).await;
            reset(client).await;
        }
        Fate::Pass | Fate::ResetBefore => {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        }
    }
}

pub async fn every_charge_happens_once_through_a_lossy_link<S: Backend>() {
    const CHARGES: usize = 40;
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone()).build().unwrap();
    let server = Running::start(crate::charges_app::app(
        layer.clone(),
        Duration::from_millis(5),
    ))
    .await;
    let link = LossyLink::start(server.addr, 0x5eed_0042).await;

    // The client as a user sets it up, with a fresh connection per attempt so that the link
    // draws a fate for each, and up to 20 attempts (the link fails 1 in 2 connections: 40 charges all through
    // in 20 is 1 - 40/2^20).
    let policy = RetryPolicy::builder()
        .max_attempts(20)
        .base_delay(Duration::from_millis(5))
        .max_delay(Duration::from_millis(40))
        .deadline(Duration::from_secs(20))
        .build()
        .unwrap();
    // The link fails one connection in two, far past what a retry budget for a healthy
    // service allows: this one holds enough for the run, so the test is about keys.
    let budget = RetryBudget::builder()
        .capacity(1000.0)
        .initial(1000.0)
        .build()
        .unwrap();
    let dependency = Dependency::new("charges", policy).with_budget(budget);
    let reqwest = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let client = Arc::new(
        ClientBuilder::new(reqwest)
            .with(RetryMiddleware::new(dependency))
            .build(),
    );

    let sends: Vec<_> = (0..CHARGES)
        .map(|i| {
            let client = client.clone();
            let url = format!("http://{}/charges", link.addr);
            tokio::spawn(async move {
                let response = client
                    .post(url)
                    .body(format!("charge {i}"))
                    .send()
                    .await
                    .expect("the client rides the link out");
                let record = RetryRecord::of(&response)
                    .expect("a response of the middleware")
                    .clone();
                let key = record
                    .idempotency_key()
                    .expect("a POST carries a key")
                    .to_str()
                    .unwrap()
                    .to_owned();
                (
                    i,
                    response.status().as_u16(),
                    key,
                    format!("{} ({})", record.attempts(), record.stop_reason()),
                )
            })
        })
        .collect();
    let mut answers = Vec::new();
    for send in sends {
        answers.push(send.await.unwrap());
    }

    let effects = store.effects().await.unwrap();
    let fates = link.fates.lock().unwrap().clone();
    for (i, status, key, attempts) in &answers {
        assert_eq!(*status, 201, "charge {i} after {attempts} attempts");
        let mine: Vec<_> = effects.iter().filter(|e| &e.key == key).collect();
        assert_eq!(
            mine.len(),
            1,
            "charge {i} (key {key}) happened once: {mine:?}"
        );
        assert_eq!(mine[0].body, format!("charge {i}"));
    }
    assert_eq!(effects.len(), CHARGES, "no duplicate, none lost");
    // The link did misbehave, each way.
    for fate in [Fate::ResetBefore, Fate::DropAnswer, Fate::CutSoon] {
        assert!(fates.contains(&fate), "the link drew {fate:?}: {fates:?}");
    }
    let counts = layer.counters().snapshot();
    assert!(
        counts.replays >= 1,
        "some answers were lost and replayed: {counts:?}"
    );
    // A completion whose request was dropped while it committed is in the table, not always
    // in the counters: the table is the truth.
    let outcomes = store.outcomes().await;
    assert_eq!(outcomes.len(), CHARGES);
    assert!(
        outcomes.iter().all(|(_, status, _)| status == "completed"),
        "{outcomes:?}"
    );
    assert!(counts.completions <= CHARGES as u64);
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_every_charge_happens_once_through_a_lossy_link() {
    every_charge_happens_once_through_a_lossy_link::<safe_retry_server::SqliteStore>().await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_every_charge_happens_once_through_a_lossy_link() {
    every_charge_happens_once_through_a_lossy_link::<safe_retry_server::PostgresStore>().await;
}
