//! A holder paused past its lease, with real processes: two processes of the charges example
//! on one database; the first is frozen (SIGSTOP) in the middle of its charge call, the order's
//! retry goes to the second, which takes the record over; the first wakes (SIGCONT) while the
//! takeover still runs. Its commit is fenced, and it answers its own caller with the takeover's
//! outcome, never `409` ("the first request with this key is still running", said to the first
//! request itself). One charge, one order row.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::processes::{Charges, signal};
use crate::receiver::Receiver;

/// The value of a counter on a process's `/metrics`.
async fn counter(client: &reqwest::Client, ops: &str, name: &str) -> u64 {
    let text = client
        .get(format!("http://{ops}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

async fn a_paused_holder_answers_its_own_caller_with_the_takeover_s_outcome(database: &str) {
    let (payments_addr, payments) = Receiver::start("ch").await;
    let (receipts_addr, _receipts) = Receiver::start("rc").await;
    let args: Vec<String> = [
        "--addr",
        "127.0.0.1:0",
        "--database-url",
        database,
        "--payments-url",
        &format!("http://{payments_addr}"),
        "--receipts-url",
        &format!("http://{receipts_addr}"),
        "--lease-ms",
        "300",
        // Only the orders' own requests finish them: no reconciler tick meanwhile.
        "--every-ms",
        "3600000",
        "--call-timeout-ms",
        "10000",
    ]
    .map(str::to_owned)
    .to_vec();
    let mut first = Charges::start(&args).await;
    let mut second = Charges::start(&args).await;
    let first_ops = ops_of(&mut first).await;
    let client = reqwest::Client::new();
    let order = |addr: String| {
        let client = client.clone();
        tokio::spawn(async move {
            let answer = client
                .post(format!("http://{addr}/orders"))
                .header("idempotency-key", "paused-1")
                .body(r#"{"item":"book"}"#)
                .send()
                .await
                .unwrap();
            let status = answer.status().as_u16();
            let replayed = answer.headers().contains_key("idempotent-replayed");
            (status, replayed, answer.bytes().await.unwrap().to_vec())
        })
    };
    let arrived = async |receiver: &Receiver| {
        tokio::time::timeout(Duration::from_secs(10), receiver.arrived.acquire())
            .await
            .expect("the charge call arrives within 10 s")
            .unwrap()
            .forget();
    };

    // The first process is frozen while the provider holds its charge call.
    payments.gate.store(true, Ordering::SeqCst);
    let from_first = order(first.addr.clone());
    arrived(&payments).await;
    signal(&first.child, "STOP");
    // Past its lease (300 ms), the order's retry goes to the second process: a takeover, whose
    // charge call (under the same downstream key) the provider holds too.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let from_second = order(second.addr.clone());
    arrived(&payments).await;
    // The first wakes and gets its call's answer; its step's commit is fenced.
    signal(&first.child, "CONT");
    payments.pass.add_permits(1);
    let fenced = async {
        while counter(&client, &first_ops, "safe_retry_server_fenced_total").await == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), fenced)
        .await
        .expect("the first holder is fenced within 10 s");
    assert!(
        !from_first.is_finished(),
        "the first waits for the takeover's outcome"
    );
    // The takeover finishes.
    payments.pass.add_permits(1);
    payments.gate.store(false, Ordering::SeqCst);
    let (second_status, _, second_body) = from_second.await.unwrap();
    assert_eq!(second_status, 201);
    let (status, replayed, body) = tokio::time::timeout(Duration::from_secs(10), from_first)
        .await
        .expect("the first answers within 10 s")
        .unwrap();
    assert_eq!(
        status,
        201,
        "the first caller is told its order's outcome, not 409: {}",
        String::from_utf8_lossy(&body)
    );
    assert!(replayed);
    assert_eq!(body, second_body, "the one outcome");
    assert_eq!(payments.effects().len(), 1, "one charge");
    let effects = client
        .get(format!("http://{}/effects?key=paused-1", second.addr))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let effects: serde_json::Value = serde_json::from_slice(&effects).unwrap();
    assert_eq!(effects["count"], 1, "one order row: {effects}");
    first.child.kill().await.unwrap();
    second.child.kill().await.unwrap();
}

async fn ops_of(process: &mut Charges) -> String {
    let line = process.line("operator's view on http://").await;
    line.strip_prefix("operator's view on http://")
        .and_then(|rest| rest.split('/').next())
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_paused_holder_answers_its_own_caller_with_the_takeover_s_outcome() {
    let dir = std::env::temp_dir().join(format!("safe-retry-pause-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let database = format!("sqlite://{}", dir.join("orders.db").display());
    a_paused_holder_answers_its_own_caller_with_the_takeover_s_outcome(&database).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_paused_holder_answers_its_own_caller_with_the_takeover_s_outcome() {
    let database = crate::support::postgres::fresh_url().await;
    a_paused_holder_answers_its_own_caller_with_the_takeover_s_outcome(&database).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_paused_holder_answers_its_own_caller_with_the_takeover_s_outcome() {
    let database = crate::support::mysql::fresh_url().await;
    a_paused_holder_answers_its_own_caller_with_the_takeover_s_outcome(&database).await;
}
