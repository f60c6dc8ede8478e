//! What a payments team met in its first month, each on every store: a store stall stored as
//! the outcome, a downstream key repeated after a renewal, a key burnt by renewals, secrets at
//! rest, one held row stalling the pool, a completed request told it failed, and the example's
//! processes racing on a new database.
//!
//! Two of the seven live beside their neighbours: `steps::a_saved_request_keeps_no_credentials`
//! (secrets at rest) and `steps::a_holder_that_wakes_after_a_resumption_is_fenced` (a fenced
//! holder answers the stored outcome).

use std::time::{Duration, Instant};

use safe_retry_server::IdempotencyLayer;

use crate::steps::{World, signalled};
use crate::support::{Answer, Backend, Running, Script, post, service};

async fn start<S: Backend>(store: S, script: Script) -> (Running, IdempotencyLayer<S>) {
    let layer = IdempotencyLayer::builder(store)
        .scope(|_| Some("caller".into()))
        .build()
        .unwrap();
    (Running::start(service(layer.clone(), script)).await, layer)
}

async fn effects_of<S: Backend>(store: &S, key: &str) -> usize {
    let effects = store.effects().await.unwrap();
    effects.iter().filter(|e| e.key == key).count()
}

/// Defect 1: The store stalls after the claim: the handler's `local()` fails, and by the time the
/// handler answers the store is back. The answer (the crate's `503`, with no driver's text) is
/// not an outcome: nothing is stored, the lease ends at once, and the retry charges.
pub async fn a_store_stall_is_never_stored_as_the_outcome<S: Backend>() {
    let store = S::fresh_impatient().await;
    let script = Script {
        after: std::sync::Arc::new(tokio::sync::Semaphore::new(0)),
        ..Script::stalled()
    };
    let (server, layer) = start(store.clone(), script.clone()).await;
    let url = server.url("/script");
    let first = {
        let url = url.clone();
        tokio::spawn(async move { post(&reqwest::Client::new(), &url, Some("k"), "a").await })
    };
    signalled(&script.began).await;
    let stall = store.stall().await;
    script.gate.add_permits(1);
    signalled(&script.wrote).await;
    drop(stall);
    script.after.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(
        first.problem_type(),
        "urn:safe-retry:problem:store-unavailable"
    );
    assert_eq!(first.header("retry-after"), Some("1"));
    let text = String::from_utf8_lossy(&first.body).to_lowercase();
    for internal in ["locked", "timed out", "pool", "sqlx"] {
        assert!(
            !text.contains(internal),
            "{internal} reached the caller: {text}"
        );
    }
    assert_eq!(layer.counters().snapshot().completions, 0);

    script.after.add_permits(1);
    let retry = post(&reqwest::Client::new(), &url, Some("k"), "a").await;
    assert_eq!(retry.status, 201, "the retry charges: {retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(effects_of(&store, "k").await, 1);
}

/// A status the layer is told not to store (a framework's own answer) ends the lease with
/// nothing stored; other statuses, `5xx` included, are outcomes.
pub async fn a_status_not_stored_leaves_the_key_for_the_retry<S: Backend>() {
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .not_stored([http::StatusCode::INTERNAL_SERVER_ERROR])
        .build()
        .unwrap();
    let server = Running::start(service(layer.clone(), Script::default())).await;
    let client = reqwest::Client::new();
    let url = server.url("/fails");
    let first = post(&client, &url, Some("k"), "a").await;
    assert_eq!(first.status, 500);
    let second = post(&client, &url, Some("k"), "a").await;
    assert_eq!(second.status, 500);
    assert_eq!(second.header("idempotent-replayed"), None, "it ran again");
    // Its effect rolled back with its transaction, each time.
    assert_eq!(effects_of(&store, "k").await, 0);
    assert_eq!(layer.counters().snapshot().unfinished, 2);
    assert_eq!(layer.counters().snapshot().completions, 0);
}

/// Defect 2: A key renewed after its retention is a new request: its charge goes to the provider under
/// a new downstream key (the provider, whose keys live longer, would replay the old charge),
/// and its receipt under a new message id. Every attempt of one record keeps its one key.
pub async fn a_renewed_key_sends_a_new_downstream_key<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    let first = world.order("k-renewed").await;
    assert_eq!(first.status, 201, "{first:?}");
    world.store.end_retention(Some("k-renewed")).await;
    let second = world.order("k-renewed").await;
    assert_eq!(second.status, 201, "{second:?}");
    assert_eq!(second.header("idempotent-replayed"), None);
    let json: serde_json::Value = serde_json::from_slice(&second.body).unwrap();
    assert_eq!(
        json["charge_replayed"], false,
        "a new charge, not the old one"
    );
    let effects = world.payments.effects();
    assert_eq!(effects.len(), 2, "{effects:?}");
    assert_ne!(
        effects[0].0, effects[1].0,
        "two records, two downstream keys"
    );
    let outbox = world.store.outbox().await.unwrap();
    assert_eq!(outbox.len(), 2, "two receipts staged: {outbox:?}");
}

/// Defect 3: Renewals start a key afresh: a key renewed more times than `max_attempts` still runs
/// (only starts within one record's generation count).
pub async fn renewals_never_burn_a_key<S: Backend>() {
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .max_attempts(2)
        .build()
        .unwrap();
    let server = Running::start(service(layer.clone(), Script::default())).await;
    let client = reqwest::Client::new();
    let url = server.url("/script");
    for round in 0..5 {
        let answer = post(&client, &url, Some("k"), "a").await;
        assert_eq!(answer.status, 201, "round {round}: {answer:?}");
        assert_eq!(answer.header("idempotent-replayed"), None, "round {round}");
        store.end_retention(Some("k")).await;
    }
    assert_eq!(effects_of(&store, "k").await, 5);
    assert_eq!(layer.counters().snapshot().failed, 0);
    // The fence still counts on across renewals.
    assert_eq!(store.outcomes().await[0].2, 5);
}

/// Defect 5: One row held locked (a holder frozen between its write and its commit) never stalls the
/// claims: on PostgreSQL the copies of its key answer `409` at once and never hold a
/// connection, so fresh keys are served; on SQLite, whose one writer is what is held, every
/// claim answers `503` within the busy timeout, and all is served once it is released.
pub async fn a_held_row_never_stalls_the_claims<S: Backend>() {
    let store = if S::ROW_LOCKS {
        S::fresh().await
    } else {
        S::fresh_impatient().await
    };
    let (server, _layer) = start(store.clone(), Script::default()).await;
    let url = server.url("/script");
    let client = reqwest::Client::new();
    assert_eq!(post(&client, &url, Some("held"), "a").await.status, 201);
    let done = post(&client, &url, Some("done"), "a").await;
    assert_eq!(done.status, 201);
    // The record is in progress and its lease is over, as a frozen holder's is.
    store.reopen("held").await;
    let lock = store.lock_row("held").await;
    let began = Instant::now();
    // A completed key's copies are replayed while the row or the file is held: read without
    // the lock.
    for _ in 0..4 {
        let copy = post(&client, &url, Some("done"), "a").await;
        assert_eq!(copy.unmarked(), done, "{copy:?}");
        assert_eq!(copy.header("idempotent-replayed"), Some("true"));
    }
    let replayed_in = began.elapsed();
    // Another request under the completed key is never given its answer.
    let other = post(&client, &url, Some("done"), "b").await;
    let expected = if S::ROW_LOCKS { 422 } else { 503 };
    assert_eq!(other.status, expected, "{other:?}");
    let copies = (0..48).map(|_| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { post(&client, &url, Some("held"), "a").await })
    });
    let fresh = (0..8).map(|i| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { post(&client, &url, Some(&format!("fresh-{i}")), "a").await })
    });
    let (copies, fresh): (Vec<_>, Vec<_>) = (copies.collect(), fresh.collect());
    let answers = async {
        let mut copied = Vec::new();
        for copy in copies {
            copied.push(copy.await.unwrap());
        }
        let mut served = Vec::new();
        for one in fresh {
            served.push(one.await.unwrap());
        }
        (copied, served)
    };
    let (copied, served): (Vec<Answer>, Vec<Answer>) =
        tokio::time::timeout(Duration::from_secs(20), answers)
            .await
            .expect("no claim waits on a held row without a bound");
    let waited = began.elapsed();
    if S::ROW_LOCKS {
        for copy in &copied {
            assert_eq!(copy.status, 409, "{copy:?}");
        }
        for one in &served {
            assert_eq!(one.status, 201, "{one:?}");
        }
    } else {
        for answer in copied.iter().chain(&served) {
            assert_eq!(answer.status, 503, "{answer:?}");
            assert_eq!(
                answer.problem_type(),
                "urn:safe-retry:problem:store-unavailable"
            );
        }
    }
    drop(lock);
    assert!(waited < Duration::from_secs(20), "{waited:?}");
    if !S::ROW_LOCKS {
        // Four replays, each after a claim that waited out the busy timeout (300 ms) and a
        // read: well within twice the bound each, on a loaded machine.
        assert!(replayed_in < Duration::from_secs(4), "{replayed_in:?}");
    }
    for i in 0..8 {
        let again = post(&client, &url, Some(&format!("fresh-{i}")), "a").await;
        assert_eq!(again.status, 201, "{again:?}");
    }
    assert_eq!(post(&client, &url, Some("held"), "a").await.status, 201);
}

/// Defect 7: Three processes of the example start together on one new database: each creates what
/// it needs (the outcome table through the migrations, its own effects table) without failing
/// on another's `CREATE TABLE`.
pub async fn three_processes_start_together_on_a_new_database<S: Backend>() {
    let database = S::empty_database().await;
    let binary = crate::walkthrough::example_binary();
    let starting = (0..3).map(|_| {
        let mut command = tokio::process::Command::new(&binary);
        command
            .args(["--addr", "127.0.0.1:0", "--database-url", &database])
            .env("RUST_LOG", "off")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        command.spawn().expect("the charges example starts")
    });
    let mut children: Vec<_> = starting.collect();
    // Each process's output is read to its end: a pipe closed early would end a process at
    // its next line (a write to a closed pipe), which a loaded machine made it reach after
    // the first was read.
    let mut draining = Vec::new();
    for child in &mut children {
        let stdout = child.stdout.take().expect("piped");
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("the example starts within 20 s")
            .expect("its stdout");
        assert!(
            first
                .as_deref()
                .is_some_and(|l| l.starts_with("charges on http://")),
            "a process failed to start: {first:?}"
        );
        draining.push(tokio::spawn(async move {
            while let Ok(Some(_)) = lines.next_line().await {}
        }));
    }
    for child in &mut children {
        assert_eq!(
            child.try_wait().unwrap(),
            None,
            "every process still serves"
        );
        child.kill().await.unwrap();
    }
}

/// Without `--database-url` each run of the example has a database of its own, which Ctrl-C
/// removes: what the README shows (the first charge is effect 1) holds whatever ran before,
/// this suite included.
pub async fn the_example_s_default_database_is_its_own_and_goes_with_it<S: Backend>() {
    if S::ROW_LOCKS {
        return; // The default is SQLite's: one run of this test is enough.
    }
    let binary = crate::walkthrough::example_binary();
    let client = reqwest::Client::new();
    let mut files = Vec::new();
    for _ in 0..2 {
        let mut child = tokio::process::Command::new(&binary)
            .args(["--addr", "127.0.0.1:0"])
            .env("RUST_LOG", "off")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the charges example starts");
        let stdout = child.stdout.take().expect("piped");
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
        let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("the example starts within 20 s")
            .expect("its stdout")
            .expect("a first line");
        let addr = first
            .strip_prefix("charges on http://")
            .and_then(|rest| rest.split(' ').next())
            .unwrap_or_else(|| panic!("{first}"));
        let file = first
            .split("(database: sqlite://")
            .nth(1)
            .and_then(|rest| rest.strip_suffix(')'))
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| panic!("{first}"));
        assert!(file.exists(), "{file:?}");
        let url = format!("http://{addr}/charges");
        for _ in 0..2 {
            let answer = post(&client, &url, Some("order-42"), "amount=1000").await;
            assert_eq!(&answer.body[..], br#"{"effect_id":1}"#, "{answer:?}");
        }
        // Ctrl-C, as a person ends the demo.
        let pid = child.id().expect("running").to_string();
        let sent = std::process::Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .expect("kill runs");
        assert!(sent.success());
        let ended = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("Ctrl-C ends the demo within 10 s")
            .unwrap();
        assert_eq!(ended.code(), Some(130));
        assert!(!file.exists(), "the demo removed its database {file:?}");
        files.push(file);
    }
    assert_ne!(files[0], files[1], "each run has a database of its own");
}

/// A shared scope's replay never carries the first caller's `Set-Cookie`; a caller's own
/// scope keeps it.
pub async fn a_replay_across_callers_never_carries_set_cookie<S: Backend>() {
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .build()
        .unwrap();
    let server = Running::start(service(layer, Script::default())).await;
    let client = reqwest::Client::new();
    let url = server.url("/script");
    let first = post(&client, &url, Some("k"), "a").await;
    assert_eq!(first.header("set-cookie"), Some("a=1"));
    let replay = post(&client, &url, Some("k"), "a").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("set-cookie"), None, "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("x-effect"), first.header("x-effect"));
}

/// Defect 7: The example's own tables, made by many servers at once on one new database: every one
/// succeeds (two `CREATE TABLE IF NOT EXISTS` at once otherwise collide in the catalogue).
pub async fn many_servers_prepare_one_new_database_at_once<S: Backend>() {
    let database = S::empty_database().await;
    for round in 0..3 {
        let database = if round == 0 {
            database.clone()
        } else {
            S::empty_database().await
        };
        let preparing = (0..12).map(|_| {
            let database = database.clone();
            tokio::spawn(async move {
                let store = S::connect_to(&database).await;
                store.prepare().await
            })
        });
        for prepared in preparing.collect::<Vec<_>>() {
            prepared
                .await
                .unwrap()
                .expect("every server prepares its tables");
        }
    }
}

/// A body that never ends is answered `408` once the layer's time for it has passed, and holds
/// nothing: no record, no effect, and the connection's memory goes with it.
pub async fn a_body_that_never_ends_is_a_408<S: Backend>() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .request_body_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let server = Running::start(service(layer.clone(), Script::default())).await;
    let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(
            b"POST /script HTTP/1.1\r\nhost: x\r\nidempotency-key: slow\r\n\
              content-length: 1000\r\n\r\nonly the start",
        )
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            let n = stream.read(&mut buf).await.unwrap_or(0);
            answer.extend_from_slice(&buf[..n]);
            if n == 0 || answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}") {
                break;
            }
        }
    });
    read.await
        .expect("answered within the time for the body, not never");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("urn:safe-retry:problem:body-timeout"),
        "{answer}"
    );
    assert!(store.outcomes().await.is_empty());
    assert_eq!(layer.counters().snapshot().refused, 1);
}

/// The sweeper deletes what the retention no longer keeps, a batch at a time, and its runner
/// goes on until nothing expired is left.
pub async fn the_sweeper_deletes_expired_records_in_batches<S: Backend>() {
    let store = S::fresh().await;
    let (server, _layer) = start(store.clone(), Script::default()).await;
    let client = reqwest::Client::new();
    for key in ["a", "b", "c"] {
        let answer = post(&client, &server.url("/script"), Some(key), "x").await;
        assert_eq!(answer.status, 201);
    }
    let sweeper = safe_retry_server::Sweeper::new(store.clone()).batch(2);
    assert_eq!(format!("{sweeper:?}"), "Sweeper { batch: 2, .. }");
    assert_eq!(
        sweeper.tick().await.unwrap().deleted,
        0,
        "nothing has expired"
    );
    store.end_retention(None).await;
    assert_eq!(sweeper.tick().await.unwrap().deleted, 2);
    assert_eq!(sweeper.tick().await.unwrap().deleted, 1);
    assert_eq!(sweeper.tick().await.unwrap().deleted, 0);
    assert!(store.outcomes().await.is_empty());
    for key in ["d", "e", "f"] {
        post(&client, &server.url("/script"), Some(key), "x").await;
    }
    store.end_retention(None).await;
    let running = tokio::spawn(sweeper.run(Duration::from_millis(10)));
    let emptied = async {
        while !store.outcomes().await.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), emptied)
        .await
        .expect("the runner sweeps within 5 s");
    running.abort();
}

on_every_store!(
    the_sweeper_deletes_expired_records_in_batches,
    a_body_that_never_ends_is_a_408,
    many_servers_prepare_one_new_database_at_once,
    a_store_stall_is_never_stored_as_the_outcome,
    a_status_not_stored_leaves_the_key_for_the_retry,
    a_renewed_key_sends_a_new_downstream_key,
    renewals_never_burn_a_key,
    a_held_row_never_stalls_the_claims,
    three_processes_start_together_on_a_new_database,
    the_example_s_default_database_is_its_own_and_goes_with_it,
    a_replay_across_callers_never_carries_set_cookie,
);
