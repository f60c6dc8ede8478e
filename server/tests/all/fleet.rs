//! A fleet under fire: three processes of the charges example on one PostgreSQL (or MySQL)
//! database, each
//! running the reconciler and the outbox relay, behind a seeded lossy link that resets and cuts
//! connections; a seeded chaos task kills one (SIGKILL, then a new process on the same
//! database) or pauses one (SIGSTOP, then SIGCONT) every few hundred milliseconds; this
//! workspace's client sends keyed orders through the link, each a charge at a payment provider
//! and a receipt through the outbox. Then every promise is counted: no duplicate, nothing lost,
//! every answer the stored one, and no caller told its order failed whose effect happened.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{Dependency, RetryMiddleware, RetryPolicy};
use safe_retry_server::store::{Operations, Standing};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::lossy_link::LossyLink;
use crate::receiver::Receiver;
use crate::support::Backend;

/// Orders sent to a fleet on a server database, and how many are in flight at once.
const ORDERS: usize = 1000;
const IN_FLIGHT: usize = 64;
/// The seed of the link's draws and of the chaos.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
const SEED: u64 = 0x00f1_ee75;
/// The SQLite fleet's seed, whose chaos kills a process at once and pauses one next (the
/// kind of each event is the seed's; its shorter run has room for only a few).
const SQLITE_SEED: u64 = 0x5c0f_fee4;

/// One server process of the fleet.
struct Server {
    child: Child,
    addr: SocketAddr,
}

/// The fleet: its processes, and the addresses the link sends to (a paused process stays in
/// the list, as a frozen server stays in a load balancer's; a killed one leaves it).
struct Fleet {
    binary: PathBuf,
    args: Vec<String>,
    servers: Vec<Option<Server>>,
    upstreams: Arc<Mutex<Vec<SocketAddr>>>,
}

impl Fleet {
    async fn start_one(&self) -> Server {
        let mut child = Command::new(&self.binary)
            .args(&self.args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("the charges example starts");
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("a server starts within 20 s")
            .expect("its stdout")
            .expect("its first line");
        let addr = first
            .strip_prefix("charges on http://")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("an unexpected first line: {first}"));
        // Its later lines are read and dropped, so a full pipe never stalls it.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Server { child, addr }
    }

    async fn kill_and_restart(&mut self, slot: usize) {
        if let Some(mut server) = self.servers[slot].take() {
            self.upstreams.lock().unwrap().retain(|a| *a != server.addr);
            let _ = signal(&server.child, "CONT");
            server.child.kill().await.expect("SIGKILL");
        }
        let server = self.start_one().await;
        self.upstreams.lock().unwrap().push(server.addr);
        self.servers[slot] = Some(server);
    }
}

fn signal(child: &Child, name: &str) -> std::io::Result<std::process::ExitStatus> {
    let pid = child.id().expect("a running process").to_string();
    std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid])
        .status()
}

/// xorshift64*, as the link draws.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// What the chaos did.
#[derive(Debug, Default)]
struct Chaos {
    kills: usize,
    pauses: usize,
}

/// Kills or pauses a server every 100–300 ms until `stop`, then leaves all three running.
async fn chaos(fleet: &mut Fleet, stop: &AtomicBool, seed: u64) -> Chaos {
    let mut state = seed;
    let mut done = Chaos::default();
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(100 + next(&mut state) % 200)).await;
        let slot = (next(&mut state) % 3) as usize;
        if next(&mut state).is_multiple_of(2) {
            fleet.kill_and_restart(slot).await;
            done.kills += 1;
        } else if let Some(server) = &fleet.servers[slot] {
            signal(&server.child, "STOP").expect("SIGSTOP");
            tokio::time::sleep(Duration::from_millis(100 + next(&mut state) % 700)).await;
            signal(&server.child, "CONT").expect("SIGCONT");
            done.pauses += 1;
        }
    }
    done
}

/// The client: this workspace's middleware, patient enough to outlast a kill (the lease is
/// 1 s) and a pause, with no budget (the test is of the server's promises, not the budget's).
fn client() -> ClientWithMiddleware {
    let policy = RetryPolicy::builder()
        .max_attempts(60)
        .base_delay(Duration::from_millis(20))
        .max_delay(Duration::from_millis(400))
        .attempt_timeout(Duration::from_millis(1500))
        .deadline(Duration::from_secs(90))
        .build()
        .unwrap();
    let dependency = Dependency::new("orders", policy).without_budget();
    // A connection per attempt, so the link draws a fate for each.
    let transport = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    ClientBuilder::new(transport)
        .with(RetryMiddleware::new(dependency))
        .build()
}

/// How one order's caller was answered.
#[derive(Debug, Clone)]
enum Told {
    Created { body: Vec<u8>, replayed: bool },
    Failed(String),
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_killed_and_paused_behind_a_lossy_link_charges_each_order_once() {
    fleet_killed_and_paused_behind_a_lossy_link::<safe_retry_server::PostgresStore>(ORDERS, SEED)
        .await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_a_fleet_killed_and_paused_behind_a_lossy_link_charges_each_order_once() {
    fleet_killed_and_paused_behind_a_lossy_link::<safe_retry_server::MySqlStore>(ORDERS, SEED)
        .await;
}

/// Three processes on one SQLite file: SQLite runs one writing transaction at a time, across
/// processes too, so the fleet is as fast as one writer; a process paused while it holds the
/// write lock holds every other back (up to the busy timeout, then `503 store-unavailable`,
/// which the client retries). A quarter of the orders: the suite runs the three fleets at once
/// on two cores, and the file's one writer is what this one is about.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_three_processes_on_one_file_killed_and_paused_charge_each_order_once() {
    fleet_killed_and_paused_behind_a_lossy_link::<safe_retry_server::SqliteStore>(
        ORDERS / 4,
        SQLITE_SEED,
    )
    .await;
}

async fn fleet_killed_and_paused_behind_a_lossy_link<S: Backend + Operations>(
    orders: usize,
    seed: u64,
) {
    let database = S::empty_database().await;
    let (payments_addr, payments) = Receiver::start("ch").await;
    let (receipts_addr, receipts) = Receiver::start("rc").await;
    let args: Vec<String> = [
        "--addr",
        "127.0.0.1:0",
        "--database-url",
        &database,
        "--payments-url",
        &format!("http://{payments_addr}"),
        "--receipts-url",
        &format!("http://{receipts_addr}"),
        "--lease-ms",
        "1000",
        "--every-ms",
        "100",
        "--effect-delay-ms",
        "0",
    ]
    .map(str::to_owned)
    .to_vec();
    let mut fleet = Fleet {
        binary: crate::walkthrough::example_binary(),
        args,
        servers: Vec::new(),
        upstreams: Arc::default(),
    };
    // The first starts alone (it makes the tables), the other two together.
    for _ in 0..3 {
        let server = fleet.start_one().await;
        fleet.upstreams.lock().unwrap().push(server.addr);
        fleet.servers.push(Some(server));
    }
    let link = LossyLink::start_to(fleet.upstreams.clone(), seed).await;

    let began = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let client = client();
    let url = format!("http://{}/orders", link.addr);
    let sending = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let permits = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
            let mut running = tokio::task::JoinSet::new();
            for i in 0..orders {
                let permit = permits.clone().acquire_owned().await.unwrap();
                let (client, url) = (client.clone(), url.clone());
                running.spawn(async move {
                    let key = format!("fleet-{i}");
                    let sent = client
                        .post(&url)
                        .header("idempotency-key", &key)
                        .body(format!("{{\"item\":{i}}}"))
                        .send()
                        .await;
                    drop(permit);
                    let told = match sent {
                        Ok(answer) if answer.status() == 201 => {
                            let replayed = answer.headers().contains_key("idempotent-replayed");
                            let body = answer.bytes().await.map(|b| b.to_vec());
                            match body {
                                Ok(body) => Told::Created { body, replayed },
                                Err(error) => Told::Failed(error.to_string()),
                            }
                        }
                        Ok(answer) => Told::Failed(format!("answered {}", answer.status())),
                        Err(error) => Told::Failed(error.to_string()),
                    };
                    (key, told)
                });
            }
            let mut told = BTreeMap::new();
            while let Some(done) = running.join_next().await {
                let (key, answer) = done.unwrap();
                told.insert(key, answer);
            }
            stop.store(true, Ordering::Relaxed);
            told
        })
    };
    let chaos = chaos(&mut fleet, &stop, seed).await;
    let told = tokio::time::timeout(Duration::from_secs(120), sending)
        .await
        .expect("every order is answered within 120 s")
        .unwrap();
    let sent_in = began.elapsed();

    // The fleet finishes what it holds: every record completed, every receipt sent.
    let store = S::connect_to(&database).await;
    let settled = async {
        loop {
            let outcomes = store.outcomes().await;
            let messages = store.outbox().await.unwrap();
            let open = outcomes.iter().filter(|(_, s, _)| s != "completed").count()
                + messages.iter().filter(|(_, s, _)| s != "sent").count();
            if open == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), settled)
        .await
        .expect("the fleet settles every record and message within 60 s");

    // Counted: no duplicate, nothing lost.
    let mut order_rows: HashMap<String, i64> = HashMap::new();
    for effect in store.effects().await.unwrap() {
        *order_rows.entry(effect.key).or_default() += 1;
    }
    let charges = payments.effects();
    let receipts_made = receipts.effects();
    let charge_keys: std::collections::HashSet<_> = charges.iter().map(|(k, _)| k).collect();
    assert_eq!(
        charge_keys.len(),
        charges.len(),
        "a downstream key charged twice"
    );
    assert_eq!(charges.len(), orders, "one charge per order");
    assert_eq!(receipts_made.len(), orders, "one receipt per order");
    assert_eq!(order_rows.len(), orders, "an order row per order");
    assert!(order_rows.values().all(|n| *n == 1), "an order row twice");
    let completed_records = store
        .records(Standing::Completed, 2 * orders as u32)
        .await
        .unwrap();
    let completed = completed_records.len();
    let takeovers: i64 = completed_records.iter().map(|r| r.starts - 1).sum();
    assert_eq!(completed, orders);

    // Every answer the stored one; no caller told it failed whose order happened. Asked of a
    // server directly, not through the link.
    let direct = fleet.servers[0].as_ref().expect("running again").addr;
    let checker = reqwest::Client::new();
    let mut replays = 0;
    let mut told_failed = Vec::new();
    for (key, answer) in &told {
        let stored = checker
            .post(format!("http://{direct}/orders"))
            .header("idempotency-key", key)
            .body(format!("{{\"item\":{}}}", &key["fleet-".len()..]))
            .send()
            .await
            .unwrap();
        assert_eq!(stored.status(), 201, "{key}");
        let stored = stored.bytes().await.unwrap();
        match answer {
            Told::Created { body, replayed } => {
                assert_eq!(body[..], stored[..], "{key}: the answer is the stored one");
                replays += usize::from(*replayed);
            }
            Told::Failed(why) => told_failed.push((key.clone(), why.clone())),
        }
    }
    // A holder paused past its lease and taken over answers its own caller from the takeover's
    // outcome (or `503 taken-over`, which the client retries): never a `409`, which this
    // workspace's client takes as final on a key's first attempt.
    let told_409 = told_failed
        .iter()
        .filter(|(_, why)| why == "answered 409 Conflict")
        .count();
    assert_eq!(
        told_409, 0,
        "callers told 409 for their own order: {told_failed:?}"
    );
    assert!(
        told_failed.is_empty(),
        "told they failed, yet charged: {told_failed:?}"
    );
    for server in fleet.servers.iter_mut().flatten() {
        let _ = signal(&server.child, "CONT");
        server.child.kill().await.unwrap();
    }
    let fates = link.fates.lock().unwrap().len();
    println!(
        "fleet on {}: {orders} orders in {sent_in:.1?}; {} kills, {} pauses; {fates} connections \
         through the link; {replays} answers were replays; {takeovers} takeovers; \
         0 duplicates, 0 lost, 0 told failed ({told_409} told 409)",
        std::any::type_name::<S>()
            .rsplit("::")
            .next()
            .unwrap_or_default(),
        chaos.kills,
        chaos.pauses
    );
    assert!(chaos.kills > 0 && chaos.pauses > 0, "{chaos:?}");
}
