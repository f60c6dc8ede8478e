//! The crash walk-through: for each recovery point of the order, run the charges example as a
//! process with a fault there, kill it with SIGKILL when it reaches it, start a new process on
//! the same database, and count what the payment provider and the receipt service did. The
//! example prints the table (`--walkthrough`); the tests assert it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

use crate::orders_app::POINTS;
use crate::receiver::Receiver;

/// The last crash point: the relay killed after the receipt service performed the delivery and
/// before the relay marked it sent.
pub const AFTER_DELIVERY: &str = "after-delivery";

/// What one crash point left, once a new process finished it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walked {
    /// The point the first process was killed at.
    pub point: &'static str,
    /// Who finished the request: `the reconciler` (the client's retry got a replay) or
    /// `a retry` (the client's retry took the record over and ran it).
    pub finished_by: &'static str,
    /// Charges the payment provider performed for the order.
    pub charges: usize,
    /// Calls the payment provider served (repeats it collapsed included).
    pub charge_calls: usize,
    /// Receipts the receipt service performed.
    pub receipts: usize,
    /// Deliveries the receipt service served (repeats it collapsed included; not the ones it
    /// refused while down, whose number depends on how soon the relay tried).
    pub receipt_calls: usize,
    /// Order rows the service wrote.
    pub order_rows: u64,
    /// The receipt's row in the outbox at the end: its status and how many times a relay took
    /// it.
    pub outbox: (String, i64),
    /// Whether the answer to every later retry was the same, byte for byte.
    pub answers_identical: bool,
}

/// Where the example's binary is, beside the running one (a test's, or the example's own).
pub fn example_binary() -> PathBuf {
    let me = std::env::current_exe().expect("the running binary's path");
    let dir = me.parent().expect("a directory");
    // A test runs from target/<profile>/deps; the example lives in target/<profile>/examples.
    let examples = if dir.ends_with("deps") {
        dir.parent().expect("target/<profile>").join("examples")
    } else {
        dir.to_path_buf()
    };
    examples.join("charges")
}

/// The example's process: its address, and its stdout's lines.
struct Process {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    addr: String,
}

impl Process {
    async fn start(binary: &Path, args: &[String]) -> Process {
        // Its events stay off unless asked for (`SAFE_RETRY_WALK_LOG=info`): the walk-through's
        // own table is what it prints.
        let log = std::env::var("SAFE_RETRY_WALK_LOG").unwrap_or_else(|_| "off".into());
        let mut child = Command::new(binary)
            .args(args)
            .env("RUST_LOG", log)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "the charges example at {} does not start ({e}): build it with \
                     `cargo build -p safe-retry-server --all-features --example charges`",
                    binary.display()
                )
            });
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        let first = lines
            .next_line()
            .await
            .expect("the example's stdout")
            .expect("the example prints its address");
        let addr = first
            .strip_prefix("charges on http://")
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("an unexpected first line: {first}"))
            .to_owned();
        Process { child, lines, addr }
    }

    /// Waits for `reached POINT` on stdout.
    async fn reached(&mut self, point: &str) {
        let wanted = format!("reached {point}");
        let reading = async {
            while let Some(line) = self.lines.next_line().await.expect("the example's stdout") {
                if line == wanted {
                    return;
                }
            }
            panic!("the example ended before it reached {point}");
        };
        tokio::time::timeout(Duration::from_secs(10), reading)
            .await
            .unwrap_or_else(|_| panic!("the example did not reach {point} in 10 s"));
    }

    /// SIGKILL, and the process reaped.
    async fn kill(mut self) {
        self.child.kill().await.expect("SIGKILL");
    }
}

/// An order answer as compared across retries: status, replay marker, body.
async fn order(client: &reqwest::Client, addr: &str, key: &str) -> Option<(u16, bool, Vec<u8>)> {
    let response = client
        .post(format!("http://{addr}/orders"))
        .header("idempotency-key", key)
        .body(r#"{"item":"book"}"#)
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    let replayed = response.headers().contains_key("idempotent-replayed");
    Some((status, replayed, response.bytes().await.ok()?.to_vec()))
}

/// The receipt's outbox row once it is no longer pending (polled every 25 ms, `polls` times
/// at most): (status, deliveries).
async fn settled_outbox(client: &reqwest::Client, addr: &str, polls: usize) -> (String, i64) {
    let mut outbox = (String::from("missing"), 0);
    for _ in 0..polls {
        let rows = client
            .get(format!("http://{addr}/outbox"))
            .send()
            .await
            .expect("the outbox")
            .bytes()
            .await
            .expect("the outbox's body");
        let rows: serde_json::Value = serde_json::from_slice(&rows).expect("JSON");
        if let Some(row) = rows.get(0) {
            outbox = (
                row["status"].as_str().unwrap_or_default().to_owned(),
                row["deliveries"].as_i64().unwrap_or_default(),
            );
            if outbox.0 != "pending" {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    outbox
}

/// Walks one point: `database` is the database's URL, the example's `--database-url`.
pub async fn walk(binary: &Path, point: &'static str, database: &str) -> Walked {
    let (payments_addr, payments) = Receiver::start("ch").await;
    let (receipts_addr, receipts) = Receiver::start("rc").await;
    let args = |crash: Option<&str>| {
        let mut args: Vec<String> = [
            "--addr",
            "127.0.0.1:0",
            "--database-url",
            database,
            "--payments-url",
            &format!("http://{payments_addr}"),
            "--receipts-url",
            &format!("http://{receipts_addr}"),
            "--lease-ms",
            "200",
            "--every-ms",
            "50",
        ]
        .map(str::to_owned)
        .to_vec();
        if let Some(point) = crash {
            args.extend(["--crash-at".to_owned(), point.to_owned()]);
        }
        args
    };
    let client = reqwest::Client::new();
    let key = format!("walk-{point}");

    // The first process, killed at the point. The receipt service is down meanwhile, so the
    // receipt waits in the outbox; for the last point it is up and holds its answer, so the
    // relay is killed after the delivery and before it marks the message sent.
    let crash = (point != AFTER_DELIVERY).then_some(point);
    if crash.is_some() {
        receipts.down.store(true, Ordering::SeqCst);
    } else {
        receipts.hold.store(true, Ordering::SeqCst);
    }
    let mut first = Process::start(binary, &args(crash)).await;
    let sent = {
        let (client, addr, key) = (client.clone(), first.addr.clone(), key.clone());
        tokio::spawn(async move { order(&client, &addr, &key).await })
    };
    match crash {
        Some(point) => first.reached(point).await,
        None => tokio::time::timeout(Duration::from_secs(10), receipts.held.acquire())
            .await
            .expect("the receipt is delivered within 10 s")
            .expect("open")
            .forget(),
    }
    // Whether the first process stored the order's answer before it died: then only the
    // receipt's delivery is left to finish. With the delivery held, the order's answer is
    // waited for: the relay may deliver the receipt (committed with the order's effects)
    // before the handler's last write lands, and this walk is the one after both.
    let completed_first = match crash {
        Some(_) => record_status(&client, &first.addr, &key).await == "completed",
        None => {
            let mut completed = false;
            for _ in 0..400 {
                completed = record_status(&client, &first.addr, &key).await == "completed";
                if completed {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            completed
        }
    };
    first.kill().await;
    let _ = sent.await;
    receipts.down.store(false, Ordering::SeqCst);
    receipts.hold.store(false, Ordering::SeqCst);

    // A new process on the same database: the reconciler and the relay run in it, and the
    // client retries until it has the answer.
    let second = Process::start(binary, &args(None)).await;
    // First nobody asks: the reconciler finishes what reached a recovery point (up to 1.5 s).
    // Then the client retries until it has the answer, and the receipt is relayed.
    for _ in 0..60 {
        if record_status(&client, &second.addr, &key).await == "completed" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let mut answers = Vec::new();
    for _ in 0..400 {
        match order(&client, &second.addr, &key).await {
            Some(answer) if answer.0 != 409 && answer.0 != 503 => {
                answers.push(answer);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
    let first_answer = answers
        .first()
        .cloned()
        .expect("the request finished in 10 s");
    let outbox = settled_outbox(&client, &second.addr, 400).await;
    for _ in 0..2 {
        answers.extend(order(&client, &second.addr, &key).await);
    }
    let effects = client
        .get(format!("http://{}/effects?key={key}", second.addr))
        .send()
        .await
        .expect("the effects")
        .bytes()
        .await
        .expect("the effects' body");
    let effects: serde_json::Value = serde_json::from_slice(&effects).expect("JSON");
    second.kill().await;
    Walked {
        point,
        finished_by: if completed_first {
            "the relay"
        } else if first_answer.1 {
            "the reconciler"
        } else {
            "a retry"
        },
        charges: payments.effects().len(),
        charge_calls: payments.served.load(Ordering::SeqCst),
        receipts: receipts.effects().len(),
        receipt_calls: receipts.served.load(Ordering::SeqCst),
        order_rows: effects["count"].as_u64().unwrap_or(0),
        outbox,
        answers_identical: answers.len() == 3
            && answers
                .iter()
                .all(|a| a.0 == first_answer.0 && a.2 == first_answer.2),
    }
}

/// The status of `key`'s record on the process at `addr` (`completed`, `in_progress`, ...), or
/// an empty string for none.
async fn record_status(client: &reqwest::Client, addr: &str, key: &str) -> String {
    let record = client
        .get(format!("http://{addr}/record?key={key}"))
        .send()
        .await
        .expect("the record");
    let record: serde_json::Value =
        serde_json::from_slice(&record.bytes().await.expect("a body")).unwrap_or_default();
    record["status"].as_str().unwrap_or_default().to_owned()
}

/// Walks every point at once, each on the database `database(point)` names.
pub async fn walk_all(binary: &Path, database: impl Fn(&str) -> String) -> Vec<Walked> {
    let binary: Arc<Path> = binary.into();
    let mut walks = tokio::task::JoinSet::new();
    for point in POINTS.into_iter().chain([AFTER_DELIVERY]) {
        let (binary, database) = (binary.clone(), database(point));
        walks.spawn(async move { walk(&binary, point, &database).await });
    }
    let mut walked: Vec<Walked> = walks.join_all().await;
    let order = |w: &Walked| {
        POINTS
            .iter()
            .position(|p| *p == w.point)
            .unwrap_or(POINTS.len())
    };
    walked.sort_by_key(order);
    walked
}
