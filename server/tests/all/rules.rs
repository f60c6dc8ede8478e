//! The layer's rules, each proved through real HTTP against a real database, on every store.
//! Effects are counted in the effects table, outcomes in the outcome table.

use safe_retry_server::IdempotencyLayer;
use std::sync::Arc;
use tokio::sync::Barrier;

use crate::support::{Answer, Backend, Running, Script, post, service};

async fn start<S: Backend>(store: S, script: Script) -> (Running, IdempotencyLayer<S>) {
    // One caller: its replays carry everything the first answer had, `Set-Cookie` included.
    let layer = IdempotencyLayer::builder(store)
        .scope(|_| Some("caller".into()))
        .build()
        .unwrap();
    (Running::start(service(layer.clone(), script)).await, layer)
}

/// A service whose first attempt at a charge waits at the gate, and a first request with key
/// `k` that has begun and waits there.
struct Held<S: Backend> {
    store: S,
    script: Script,
    server: Running,
    layer: IdempotencyLayer<S>,
    url: String,
    first: tokio::task::JoinHandle<Answer>,
}

async fn first_request_held<S: Backend>() -> Held<S> {
    let store = S::fresh().await;
    let script = Script::stalled();
    let (server, layer) = start(store.clone(), script.clone()).await;
    let url = server.url("/script");
    let first = post_in_background(&url, "k", "amount=10");
    began_within_10_s(&script.began, "the first request's handler").await;
    Held {
        store,
        script,
        server,
        layer,
        url,
        first,
    }
}

/// Waits (at most 10 s) for one permit of `signal`: a store that fails every statement never
/// runs a handler, and the test fails saying what never began instead of waiting for ever.
async fn began_within_10_s(signal: &tokio::sync::Semaphore, what: &str) {
    tokio::time::timeout(std::time::Duration::from_secs(10), signal.acquire())
        .await
        .unwrap_or_else(|_| panic!("{what} did not begin within 10 s"))
        .unwrap()
        .forget();
}

/// Sends a POST from a task of its own, on a connection of its own.
fn post_in_background(
    url: &str,
    key: &'static str,
    body: &'static str,
) -> tokio::task::JoinHandle<Answer> {
    let url = url.to_owned();
    tokio::spawn(async move { post(&reqwest::Client::new(), &url, Some(key), body).await })
}

async fn effects_of<S: Backend>(store: &S, key: &str) -> usize {
    store
        .effects()
        .await
        .unwrap()
        .iter()
        .filter(|e| e.key == key)
        .count()
}

/// Same key twice, one after the other: one effect, and the second answer is the first's,
/// status, headers and body, plus the replay marker.
pub async fn same_key_twice_is_one_effect_and_one_answer<S: Backend>() {
    let store = S::fresh().await;
    let (server, layer) = start(store.clone(), Script::default()).await;
    let client = reqwest::Client::new();
    let url = server.url("/script");
    let first = post(&client, &url, Some("k-1"), "amount=10").await;
    let second = post(&client, &url, Some("k-1"), "amount=10").await;
    let third = post(&client, &url, Some("\"k-1\""), "amount=10").await;

    assert_eq!(first.status, 201);
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.header("set-cookie"), Some("a=1"));
    let json: serde_json::Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(
        (
            json["attempt"].as_i64(),
            json["taken_over"].as_bool(),
            json["scope"].as_str()
        ),
        (Some(1), Some(false), Some("caller"))
    );
    let execution = json["execution"].as_str().unwrap();
    assert!(
        execution.starts_with("Execution { scope: \"caller\", key: \"k-1\", fence: Fence { id: "),
        "{execution}"
    );
    assert!(
        execution.ends_with(", attempt: 1 }, taken_over: false, .. }"),
        "{execution}"
    );
    assert_eq!(
        json["local"], "Local(..)",
        "the handler's transaction, taken again after its effect"
    );
    assert_eq!(second.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        second.unmarked(),
        first,
        "a replay is the first answer byte for byte"
    );
    assert_eq!(third, second, "the quoted spelling is the same key");
    assert_eq!(effects_of(&store, "k-1").await, 1);
    assert_eq!(
        store.outcomes().await,
        [("k-1".to_owned(), "completed".to_owned(), 1)]
    );
    let counts = layer.counters().snapshot();
    assert_eq!(
        (counts.claims, counts.completions, counts.replays),
        (1, 1, 2)
    );
}

/// 32 copies of one request at once, from 32 connections released by a barrier, on a
/// multi-thread runtime, in several rounds: exactly one effect a round; every answer is the
/// one success or a 409, never a 5xx.
pub async fn thirty_two_at_once_make_one_effect<S: Backend>() {
    let store = S::fresh().await;
    let (server, layer) = start(store.clone(), Script::default()).await;
    let url = server.url("/script");
    const COPIES: usize = 32;
    const ROUNDS: usize = 8;
    for round in 0..ROUNDS {
        let key = format!("race-{round}");
        let barrier = Arc::new(Barrier::new(COPIES));
        let copies: Vec<_> = (0..COPIES)
            .map(|_| {
                let (barrier, url, key) = (barrier.clone(), url.clone(), key.clone());
                tokio::spawn(async move {
                    let client = reqwest::Client::new();
                    barrier.wait().await;
                    post(&client, &url, Some(&key), "amount=10").await
                })
            })
            .collect();
        let mut answers = Vec::new();
        for copy in copies {
            answers.push(copy.await.unwrap());
        }
        let originals: Vec<&Answer> = answers
            .iter()
            .filter(|a| a.status == 201 && a.header("idempotent-replayed").is_none())
            .collect();
        assert_eq!(
            originals.len(),
            1,
            "round {round}: one copy ran: {answers:#?}"
        );
        let original = originals[0];
        for answer in &answers {
            match answer.status {
                409 => {
                    assert_eq!(answer.problem_type(), "urn:safe-retry:problem:in-progress");
                    assert!(answer.header("retry-after").is_some());
                }
                201 => assert_eq!(&answer.unmarked(), original, "round {round}"),
                other => panic!("round {round}: a copy got {other}: {answer:?}"),
            }
        }
        assert_eq!(effects_of(&store, &key).await, 1, "round {round}");
    }
    let counts = layer.counters().snapshot();
    assert_eq!(counts.claims, ROUNDS as u64);
    assert_eq!(
        counts.replays + counts.in_progress,
        (ROUNDS * (COPIES - 1)) as u64
    );
    assert_eq!(store.effects().await.unwrap().len(), ROUNDS);
}

/// The same key with another body is a 422, before and after the first completes, and never
/// a second effect.
pub async fn another_request_under_the_key_is_422_and_no_effect<S: Backend>() {
    let Held {
        store,
        script,
        server,
        layer,
        url,
        first,
    } = first_request_held::<S>().await;
    let client = reqwest::Client::new();
    let during = post(&client, &url, Some("k"), "amount=99").await;
    assert_eq!(during.status, 422);
    assert_eq!(during.problem_type(), "urn:safe-retry:problem:key-reused");
    assert_eq!(
        during.header("content-type"),
        Some("application/problem+json")
    );
    script.gate.add_permits(1);
    assert_eq!(first.await.unwrap().status, 201);
    let after = post(&client, &url, Some("k"), "amount=99").await;
    assert_eq!(after.status, 422);
    let other_path = post(&client, &server.url("/validated"), Some("k"), "amount=10").await;
    assert_eq!(other_path.status, 422, "the path is part of the request");
    assert_eq!(effects_of(&store, "k").await, 1);
    assert_eq!(layer.counters().snapshot().mismatches, 3);
}

/// While the first runs, the same request gets a 409 with `Retry-After`; once it completes,
/// the stored answer.
pub async fn in_progress_is_a_409_with_retry_after<S: Backend>() {
    let Held {
        store,
        script,
        server: _server,
        layer: _layer,
        url,
        first,
    } = first_request_held::<S>().await;
    let client = reqwest::Client::new();
    let during = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(during.status, 409);
    assert_eq!(during.problem_type(), "urn:safe-retry:problem:in-progress");
    let after: u64 = during.header("retry-after").unwrap().parse().unwrap();
    assert!(
        (1..=30).contains(&after),
        "Retry-After {after} is within the 30 s lease"
    );
    script.gate.add_permits(1);
    let first = first.await.unwrap();
    let replay = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(replay.unmarked(), first);
    assert_eq!(effects_of(&store, "k").await, 1);
}

/// A handler's rejection before it did anything is not stored: the corrected request with the
/// same key runs, once.
pub async fn a_rejection_is_not_stored_and_the_corrected_retry_runs_once<S: Backend>() {
    let store = S::fresh().await;
    let (server, layer) = start(store.clone(), Script::default()).await;
    let client = reqwest::Client::new();
    let url = server.url("/validated");
    let rejected = post(&client, &url, Some("k"), "amount=bad").await;
    assert_eq!(
        (rejected.status, rejected.body.as_slice()),
        (422, &b"amount must be positive"[..])
    );
    assert_eq!(rejected.header("idempotent-replayed"), None);
    assert_eq!(store.outcomes().await, []);
    let again = post(&client, &url, Some("k"), "amount=bad").await;
    assert_eq!(
        again.header("idempotent-replayed"),
        None,
        "a rejection is never replayed"
    );
    let corrected = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(corrected.status, 201);
    let replay = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(replay.unmarked(), corrected);
    assert_eq!(effects_of(&store, "k").await, 1);
    assert_eq!(layer.counters().snapshot().rejections, 2);
}

/// A 5xx the handler answered after it began is stored with its effects and replayed.
pub async fn a_5xx_after_the_handler_began_is_stored_and_replayed<S: Backend>() {
    let store = S::fresh().await;
    let (server, _layer) = start(store.clone(), Script::default()).await;
    let client = reqwest::Client::new();
    let url = server.url("/fails");
    let first = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(first.status, 500);
    let replay = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.unmarked(), first);
    assert_eq!(effects_of(&store, "k").await, 1);
}

/// The first holder stalls past its lease; a second request takes the record over and
/// completes; the first's completion is refused and its effect rolled back: one effect, one
/// stored answer, which the first caller gets too.
pub async fn a_takeover_fences_the_stalled_holder<S: Backend>() {
    let Held {
        store,
        script,
        server: _server,
        layer,
        url,
        first,
    } = first_request_held::<S>().await;
    store.end_lease("k").await;
    let client = reqwest::Client::new();
    let second = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(second.status, 201);
    let json: serde_json::Value = serde_json::from_slice(&second.body).unwrap();
    assert_eq!(json["attempt"], 2, "the takeover runs as attempt 2");
    assert_eq!(json["taken_over"], true);
    assert_eq!(layer.counters().snapshot().takeovers, 1);

    script.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(
        first.header("idempotent-replayed"),
        Some("true"),
        "the fenced holder answers with the recovered outcome"
    );
    assert_eq!(first.unmarked(), second);
    assert_eq!(
        effects_of(&store, "k").await,
        1,
        "the fenced holder's effect rolled back"
    );
    assert_eq!(
        store.outcomes().await,
        [("k".to_owned(), "completed".to_owned(), 2)]
    );
    let counts = layer.counters().snapshot();
    assert_eq!((counts.fenced, counts.completions), (1, 1));
}

/// After retention the key is new again; the sweep deletes expired records in batches and
/// nothing else.
pub async fn after_retention_the_key_is_new_and_the_sweep_goes_in_batches<S: Backend>() {
    let store = S::fresh().await;
    let (server, _layer) = start(store.clone(), Script::default()).await;
    let client = reqwest::Client::new();
    let url = server.url("/charges");
    let first = post(&client, &url, Some("k"), "amount=10").await;
    store.end_retention(Some("k")).await;
    let again = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_ne!(again.body, first.body, "a new effect");
    assert_eq!(effects_of(&store, "k").await, 2);
    // Another request is welcome under an expired key, too.
    store.end_retention(Some("k")).await;
    assert_eq!(
        post(&client, &url, Some("k"), "amount=20").await.status,
        201
    );

    for i in 0..24 {
        post(&client, &url, Some(&format!("old-{i}")), "amount=1").await;
    }
    store.end_retention(None).await;
    post(&client, &url, Some("kept"), "amount=1").await;
    let mut batches = Vec::new();
    loop {
        let deleted = store.sweep(10).await.unwrap();
        batches.push(deleted);
        if deleted < 10 {
            break;
        }
        assert!(batches.len() < 10, "the sweep ends");
    }
    assert_eq!(batches, [10, 10, 5]);
    assert_eq!(
        store.outcomes().await,
        [("kept".to_owned(), "completed".to_owned(), 1)]
    );
}

/// Malformed keys, enormous keys, keys with control characters and bodies over the limit are
/// each answered with a problem that says what is wrong; nothing is stored or done.
pub async fn bad_input_gets_a_clear_answer_and_changes_nothing<S: Backend>() {
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .max_request_body(1024)
        .build()
        .unwrap();
    let server = Running::start(service(layer, Script::default())).await;
    let client = reqwest::Client::new();
    let url = server.url("/charges");

    let missing = post(&client, &url, None, "amount=10").await;
    assert_eq!(
        (missing.status, missing.problem_type().as_str()),
        (400, "urn:safe-retry:problem:missing-key")
    );
    // A missing key is answered before the body is read, whatever its size.
    let missing_and_big = post(&client, &url, None, &"x".repeat(4096)).await;
    assert_eq!(
        missing_and_big.problem_type(),
        "urn:safe-retry:problem:missing-key"
    );

    let long = "k".repeat(10_000);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"\"unterminated".to_vec(), "no closing quote"),
        (b"a\tb".to_vec(), "control"),
        (b"caf\xc3\xa9".to_vec(), "ASCII"),
        (b"\"a\";param=1".to_vec(), "parameters"),
        (long.clone().into_bytes(), "10000 bytes long"),
        (b"".to_vec(), "empty"),
        // Two keys a proxy merged into one field.
        (b"k1, k2".to_vec(), "two keys joined"),
    ];
    for (value, reason) in cases {
        let response = client
            .post(&url)
            .header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(&value).unwrap(),
            )
            .body("amount=10")
            .send()
            .await
            .unwrap();
        let answer = Answer::of(response).await;
        assert_eq!(answer.status, 400, "{value:?}");
        assert_eq!(
            answer.problem_type(),
            "urn:safe-retry:problem:malformed-key"
        );
        let detail = serde_json::from_slice::<serde_json::Value>(&answer.body).unwrap()["detail"]
            .to_string();
        assert!(detail.contains(reason), "{reason:?} in {detail}");
    }
    let twice = client
        .post(&url)
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .send()
        .await
        .unwrap();
    assert_eq!(twice.status(), 400);

    let big = post(&client, &url, Some("big"), &"x".repeat(2048)).await;
    assert_eq!(
        (big.status, big.problem_type().as_str()),
        (413, "urn:safe-retry:problem:body-too-large")
    );
    let fits = post(&client, &url, Some("fits"), &"x".repeat(1024)).await;
    assert_eq!(fits.status, 201, "a body of exactly the limit is read");

    assert_eq!(
        store.outcomes().await,
        [("fits".to_owned(), "completed".to_owned(), 1)]
    );
    assert_eq!(store.effects().await.unwrap().len(), 1);
}

/// The store fails while a request runs: the answer is a 503 problem, and the effect the
/// handler wrote rolled back with the failed completion.
pub async fn a_store_failing_mid_request_leaves_nothing_half_written<S: Backend>() {
    let Held {
        store,
        script,
        server: _server,
        layer,
        url,
        first,
    } = first_request_held::<S>().await;
    store.break_outcomes().await;
    script.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, first.problem_type().as_str()),
        (503, "urn:safe-retry:problem:store-unavailable")
    );
    assert_eq!(first.header("retry-after"), Some("1"));
    assert_eq!(
        store.effects().await.unwrap(),
        [],
        "the effect rolled back with the completion"
    );
    let next = post(&reqwest::Client::new(), &url, Some("k2"), "amount=10").await;
    assert_eq!(next.status, 503, "a claim on a failed store runs nothing");
    assert_eq!(store.effects().await.unwrap(), []);
    assert_eq!(layer.counters().snapshot().store_failures, 2);
}

/// Scope keys by caller: one key from two callers is two records; a request the scope
/// function finds no caller for is a 401 and runs nothing.
/// Keys and scopes are compared byte for byte: no collation makes two keys one (case, a
/// trailing space, `ß` and `ss`, composed and decomposed accents, full-width letters). Each
/// is a record of its own, read back with its own fingerprint.
pub async fn keys_and_scopes_are_compared_byte_for_byte<S: Backend>() {
    use safe_retry_server::store::Claim;
    let store = S::fresh().await;
    let pairs = [
        ("", "k"),
        ("", "K"),
        ("", "k "),
        ("", " k"),
        ("", "\u{ff4b}"),
        ("", "ss"),
        ("", "\u{df}"),
        ("", "\u{e9}"),
        ("", "e\u{301}"),
        ("a", "k"),
        ("A", "k"),
        ("a ", "k"),
    ];
    for (i, (scope, key)) in pairs.iter().enumerate() {
        let fingerprint = [i as u8; 32];
        let claim = Claim {
            scope,
            key,
            fingerprint: &fingerprint,
            lease: std::time::Duration::from_secs(30),
            retention: std::time::Duration::from_secs(60),
        };
        assert!(
            store.try_claim(&claim).await.unwrap().is_some(),
            "({scope:?}, {key:?}) is a new key"
        );
    }
    for (i, (scope, key)) in pairs.iter().enumerate() {
        let record = store.read(scope, key).await.unwrap().expect("its record");
        assert_eq!(record.fingerprint, [i as u8; 32], "({scope:?}, {key:?})");
    }
    let keys: Vec<String> = store
        .outcomes()
        .await
        .into_iter()
        .map(|(k, _, _)| k)
        .collect();
    assert_eq!(keys.len(), pairs.len());
    assert!(keys.iter().any(|k| k == "e\u{301}") && keys.iter().any(|k| k == " k"));
}

pub async fn keys_are_scoped_by_caller<S: Backend>() {
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .scope(|parts| {
            parts
                .headers
                .get("x-tenant")?
                .to_str()
                .ok()
                .map(str::to_owned)
        })
        .build()
        .unwrap();
    let server = Running::start(service(layer, Script::default())).await;
    let client = reqwest::Client::new();
    let url = server.url("/script");
    for tenant in ["a", "b", "a"] {
        let response = client
            .post(&url)
            .header("idempotency-key", "k")
            .header("x-tenant", tenant)
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        let json: serde_json::Value =
            serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
        assert_eq!(
            json["scope"], tenant,
            "the handler runs in its caller's scope"
        );
    }
    let anonymous = post(&client, &url, Some("k"), "x").await;
    assert_eq!(
        (anonymous.status, anonymous.problem_type().as_str()),
        (401, "urn:safe-retry:problem:no-scope")
    );
    assert_eq!(effects_of(&store, "k").await, 2);
}

/// An answer over the storage limit reaches its caller whole; a replay says the request
/// completed, with its status and the replay marker.
pub async fn an_answer_over_the_limit_is_sent_whole_and_its_status_replayed<S: Backend>() {
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .max_answer_body(8)
        .build()
        .unwrap();
    let server = Running::start(service(layer, Script::default())).await;
    let client = reqwest::Client::new();
    let url = server.url("/charges");
    let first = post(&client, &url, Some("k"), "x").await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body, b"{\"effect_id\":1}");
    let replay = post(&client, &url, Some("k"), "x").await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        replay.problem_type(),
        "urn:safe-retry:problem:answer-not-stored"
    );
    assert_eq!(effects_of(&store, "k").await, 1);

    // An answer of exactly the limit is stored whole.
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .max_answer_body(b"{\"effect_id\":1}".len())
        .build()
        .unwrap();
    let server = Running::start(service(layer, Script::default())).await;
    let url = server.url("/charges");
    let first = post(&client, &url, Some("k"), "x").await;
    let replay = post(&client, &url, Some("k"), "x").await;
    assert_eq!(replay.unmarked(), first);
}

/// A holder fenced out by a request that renewed the key after its retention, with another
/// body or with the same one: the stalled holder never answers with the other generation's
/// outcome (its fence compares the record's identity, not only the body's fingerprint), and
/// never `409`: it says `503 taken-over`, which a client retries with the same key.
pub async fn a_fenced_holder_never_answers_with_another_request_s_outcome<S: Backend>() {
    for body in ["amount=99", "amount=10"] {
        let Held {
            store,
            script,
            server: _server,
            layer,
            url,
            first,
        } = first_request_held::<S>().await;
        store.end_lease("k").await;
        store.end_retention(Some("k")).await;
        let other = post(&reqwest::Client::new(), &url, Some("k"), body).await;
        assert_eq!(
            other.status, 201,
            "after its retention the key takes another request"
        );
        script.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!(
            (first.status, first.problem_type().as_str()),
            (503, "urn:safe-retry:problem:taken-over"),
            "renewed with {body}"
        );
        assert!(first.header("retry-after").is_some());
        assert_eq!(layer.counters().snapshot().fenced, 1);
        let effects = store.effects().await.unwrap();
        assert_eq!(effects.len(), 1);
        assert_eq!(effects[0].body, body);
    }
}

/// A holder stalled past its lease (a paused process) and taken over by another server's
/// attempt: when it wakes while the takeover still runs, its completion is fenced, and it
/// waits for the takeover's outcome and replays it to its caller, never a `409` to the
/// request that came first.
pub async fn a_fenced_holder_waits_for_the_takeover_s_outcome_and_replays_it<S: Backend>() {
    use bytes::Bytes;
    use safe_retry_server::store::{Claim, Completion, StoredAnswer};
    use std::time::Duration;
    let Held {
        store,
        script,
        server: _server,
        layer,
        url: _,
        first,
    } = first_request_held::<S>().await;
    store.end_lease("k").await;
    let record = store.read("caller", "k").await.unwrap().unwrap();
    let claim = Claim {
        scope: "caller",
        key: "k",
        fingerprint: &record.fingerprint,
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    let takeover = store.try_claim(&claim).await.unwrap().expect("a takeover");
    assert!(takeover.taken_over);
    assert_eq!(
        takeover.identity, record.identity,
        "one record, one identity"
    );
    script.gate.add_permits(1);
    let fenced = async {
        while layer.counters().snapshot().fenced == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), fenced)
        .await
        .expect("the first holder is fenced within 10 s");
    assert!(!first.is_finished(), "it waits for the takeover's outcome");
    let answer = StoredAnswer {
        status: http::StatusCode::CREATED,
        headers: vec![],
        body: Some(Bytes::from_static(b"{\"by\":\"the takeover\"}")),
    };
    assert_eq!(
        store.complete(None, takeover.fence, &answer).await.unwrap(),
        Completion::Completed
    );
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.body, b"{\"by\":\"the takeover\"}");
    assert_eq!(first.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        effects_of(&store, "k").await,
        0,
        "its own effect rolled back"
    );
}

/// Downstream keys derive from the record's identity: random, so the same key as the first
/// record of two databases gives two identities (row ids start from 1 in each); kept through
/// a takeover; new when the key is renewed after its retention.
pub async fn a_record_s_identity_is_new_in_every_database_and_kept_through_takeovers<S: Backend>() {
    use safe_retry_server::store::Claim;
    use std::time::Duration;
    let claim = Claim {
        scope: "caller",
        key: "order-1",
        fingerprint: &[7; 32],
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    let (one, two) = (S::fresh().await, S::fresh().await);
    let first = one.try_claim(&claim).await.unwrap().unwrap();
    let other = two.try_claim(&claim).await.unwrap().unwrap();
    assert_eq!(first.fence.id, other.fence.id, "each database's first row");
    assert_ne!(first.identity, other.identity);
    for identity in [&first.identity, &other.identity] {
        assert_eq!(identity.len(), 32, "{identity}");
        assert!(
            identity.bytes().all(|b| b.is_ascii_hexdigit()),
            "{identity}"
        );
    }
    one.end_lease("order-1").await;
    let takeover = one.try_claim(&claim).await.unwrap().unwrap();
    assert!(takeover.taken_over);
    assert_eq!(takeover.identity, first.identity);
    one.end_lease("order-1").await;
    one.end_retention(Some("order-1")).await;
    let renewed = one.try_claim(&claim).await.unwrap().unwrap();
    assert!(!renewed.taken_over);
    assert_ne!(renewed.identity, first.identity);
}

/// A record in progress at a recovery point (its external call may have happened) whose
/// retention ends is never swept nor renewed: the reconciler still finds it, a retry with its
/// body takes it over with its steps and identity kept (and its retention starts again), and
/// another body is still refused.
pub async fn a_recovery_point_outlives_its_retention<S: Backend>() {
    use safe_retry_server::store::{Claim, Completion, StepWrite};
    use std::time::Duration;
    let store = S::fresh().await;
    let claim = Claim {
        scope: "caller",
        key: "order-1",
        fingerprint: &[7; 32],
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    };
    let first = store.try_claim(&claim).await.unwrap().unwrap();
    let point = StepWrite {
        point: "charge:started",
        steps: Some("{\"order\":1}"),
        request: Some(b"saved"),
        lease: Duration::from_secs(30),
    };
    assert_eq!(
        store.commit_step(None, first.fence, &point).await.unwrap(),
        Completion::Completed
    );
    store.end_lease("order-1").await;
    store.end_retention(Some("order-1")).await;
    assert_eq!(store.sweep(100).await.unwrap(), 0, "never swept");
    let stalled = store.stalled(10).await.unwrap();
    assert_eq!(stalled.len(), 1, "the reconciler still finds it");
    let other = Claim {
        fingerprint: &[8; 32],
        ..claim
    };
    assert_eq!(
        store.try_claim(&other).await.unwrap(),
        None,
        "never renewed"
    );
    let resumed = store.try_claim(&claim).await.unwrap().unwrap();
    assert!(resumed.taken_over);
    assert_eq!(resumed.identity, first.identity);
    assert_eq!(resumed.generation, first.generation);
    let progress = store.progress(resumed.fence).await.unwrap();
    assert_eq!(progress.steps.as_deref(), Some("{\"order\":1}"));
    // Its retention started again with the takeover: a sweep now leaves it too.
    store.end_lease("order-1").await;
    assert_eq!(store.sweep(100).await.unwrap(), 0);
    assert_eq!(store.outcomes().await.len(), 1);
}

/// Where no key is required, a request without one runs every time with nothing stored; other
/// methods pass through.
pub async fn unguarded_requests_pass_through<S: Backend>() {
    let store = S::fresh().await;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .require_key(false)
        .build()
        .unwrap();
    let script = Script::default();
    let server = Running::start(service(layer, script.clone())).await;
    let client = reqwest::Client::new();
    let url = server.url("/plain");
    for _ in 0..2 {
        let answer = post(&client, &url, None, "x").await;
        assert_eq!(
            (answer.status, answer.body.as_slice()),
            (200, &b"no execution"[..])
        );
    }
    let keyed = post(&client, &url, Some("k"), "x").await;
    assert_eq!(keyed.body, b"an execution");
    assert_eq!(
        post(&client, &url, Some("k"), "x")
            .await
            .header("idempotent-replayed"),
        Some("true")
    );
    assert_eq!(
        script
            .plain_calls
            .load(std::sync::atomic::Ordering::Relaxed),
        3
    );
    assert_eq!(
        store.outcomes().await,
        [("k".to_owned(), "completed".to_owned(), 1)]
    );
    let put = client.put(&url).body("x").send().await.unwrap();
    assert_eq!(
        put.status(),
        405,
        "a PUT passes the layer to the router, which has no PUT route"
    );
    assert_eq!(store.outcomes().await.len(), 1);
}

/// A completion that ran into the lease's end by so little that the takeover has not yet
/// written: the takeover waits for it, finds it completed, and replays it.
pub async fn a_claim_on_a_record_completing_now_gets_its_answer<S: Backend>() {
    let store = S::fresh().await;
    let (server, _layer) = start(store.clone(), Script::default()).await;
    let client = reqwest::Client::new();
    let url = server.url("/script");
    let first = post(&client, &url, Some("k"), "amount=10").await;
    store.end_lease("k").await;
    let second = post(&client, &url, Some("k"), "amount=10").await;
    assert_eq!(
        second.unmarked(),
        first,
        "a completed record is never taken over, lease or not"
    );
    assert_eq!(effects_of(&store, "k").await, 1);
}

/// A caller that gives up while the handler runs closes its connection; the server drops the
/// request, its transaction rolls back, and its lease ends at once: the retry takes over
/// without waiting 30 s, and one effect is made.
pub async fn a_request_dropped_mid_handler_ends_its_lease_for_the_retry<S: Backend>() {
    let store = S::fresh().await;
    let script = Script::stalled();
    let (server, layer) = start(store.clone(), script.clone()).await;
    let url = server.url("/script");
    // Real time: the caller's own timeout, while the handler is held at the gate.
    let impatient = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(50))
        .build()
        .unwrap();
    let gave_up = impatient
        .post(&url)
        .header("idempotency-key", "k")
        .body("amount=10")
        .send()
        .await;
    assert!(gave_up.unwrap_err().is_timeout());
    let mut polls = 0;
    loop {
        let lease_over = match store.read("caller", "k").await.unwrap() {
            Some(record) => {
                matches!(record.state, safe_retry_server::store::RecordState::InProgress { lease_left } if lease_left.is_zero())
            }
            None => false,
        };
        if lease_over {
            break;
        }
        polls += 1;
        assert!(
            polls < 250,
            "the lease of the dropped request ends within 5 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let retry = post(&reqwest::Client::new(), &url, Some("k"), "amount=10").await;
    assert_eq!(retry.status, 201);
    let json: serde_json::Value = serde_json::from_slice(&retry.body).unwrap();
    assert_eq!(json["attempt"], 2);
    assert_eq!(effects_of(&store, "k").await, 1);
    let counts = layer.counters().snapshot();
    assert_eq!((counts.abandoned, counts.takeovers), (1, 1));
}

/// A caller that hangs up while its claim statement waits on the database: the claim lands
/// after the request is gone, and its own task ends the lease, so the retry takes over at
/// once instead of meeting a record nobody holds for 30 s.
pub async fn a_request_dropped_while_it_claims_leaves_nothing_held<S: Backend>() {
    let store = S::fresh().await;
    let (server, layer) = start(store.clone(), Script::default()).await;
    let url = server.url("/script");
    let writes = store.hold_writes().await;
    // Real time: the caller's own timeout, while its claim waits for the write lock.
    let impatient = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(100))
        .build()
        .unwrap();
    let gave_up = impatient
        .post(&url)
        .header("idempotency-key", "k")
        .body("amount=10")
        .send()
        .await;
    assert!(gave_up.unwrap_err().is_timeout());
    drop(writes);
    // Until the record's lease has ended in the table: the counter counts the abandonment as
    // it begins, before its statement lands (a retry sent between the two, on a loaded
    // machine, met the lease still running).
    let mut polls = 0;
    loop {
        let lease_over = match store.read("caller", "k").await.unwrap() {
            Some(record) => {
                matches!(record.state, safe_retry_server::store::RecordState::InProgress { lease_left } if lease_left.is_zero())
            }
            None => false,
        };
        if lease_over && layer.counters().snapshot().abandoned == 1 {
            break;
        }
        polls += 1;
        assert!(polls < 250, "the claim's task ends its lease within 5 s");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let retry = post(&reqwest::Client::new(), &url, Some("k"), "amount=10").await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(effects_of(&store, "k").await, 1);
    assert_eq!(
        layer.counters().snapshot().takeovers,
        1,
        "the retry took over the claim nobody heard"
    );
}

on_every_store!(
    same_key_twice_is_one_effect_and_one_answer,
    thirty_two_at_once_make_one_effect,
    another_request_under_the_key_is_422_and_no_effect,
    in_progress_is_a_409_with_retry_after,
    a_rejection_is_not_stored_and_the_corrected_retry_runs_once,
    a_5xx_after_the_handler_began_is_stored_and_replayed,
    a_takeover_fences_the_stalled_holder,
    after_retention_the_key_is_new_and_the_sweep_goes_in_batches,
    bad_input_gets_a_clear_answer_and_changes_nothing,
    a_store_failing_mid_request_leaves_nothing_half_written,
    keys_are_scoped_by_caller,
    keys_and_scopes_are_compared_byte_for_byte,
    an_answer_over_the_limit_is_sent_whole_and_its_status_replayed,
    unguarded_requests_pass_through,
    a_claim_on_a_record_completing_now_gets_its_answer,
    a_request_dropped_mid_handler_ends_its_lease_for_the_retry,
    a_request_dropped_while_it_claims_leaves_nothing_held,
    a_fenced_holder_never_answers_with_another_request_s_outcome,
    a_fenced_holder_waits_for_the_takeover_s_outcome_and_replays_it,
    a_record_s_identity_is_new_in_every_database_and_kept_through_takeovers,
    a_recovery_point_outlives_its_retention,
);

/// The server cut every connection while the handler held its transaction with its effect
/// written: a 503, and no effect.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn cut_mid_request_leaves_nothing_half_written<S: Backend>(cut: impl AsyncFnOnce(&S)) {
    let store = S::fresh().await;
    let script = Script::stalled_after();
    let (server, _layer) = start(store.clone(), script.clone()).await;
    let url = server.url("/script");
    let first = post_in_background(&url, "k", "amount=10");
    began_within_10_s(&script.wrote, "the charge's effect").await;
    cut(&store).await;
    script.after.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, first.problem_type().as_str()),
        (503, "urn:safe-retry:problem:store-unavailable")
    );
    assert_eq!(
        store.effects().await.unwrap(),
        [],
        "the effect was never committed"
    );
    // The record stays in progress for its lease: the next retry after it runs the charge.
    store.end_lease("k").await;
    script.after.add_permits(1);
    let retry = post(&reqwest::Client::new(), &url, Some("k"), "amount=10").await;
    assert_eq!(retry.status, 201);
    assert_eq!(effects_of(&store, "k").await, 1);
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_cut_mid_request_leaves_nothing_half_written() {
    cut_mid_request_leaves_nothing_half_written(async |store| {
        crate::support::postgres::cut_connections(store).await
    })
    .await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_cut_mid_request_leaves_nothing_half_written() {
    cut_mid_request_leaves_nothing_half_written(async |store| {
        crate::support::mysql::cut_connections(store).await
    })
    .await;
}

/// What a completion clears (the saved request, a caller's headers in it) is overwritten in a
/// SQLite file, not left in its free pages: `secure_delete` is on by default; off, the bytes
/// stay (the test's own control).
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_overwrites_a_cleared_saved_request() {
    use safe_retry_server::SqliteStore;
    use safe_retry_server::store::{Claim, Outcomes, RecoveryPoints, StepWrite, StoredAnswer};
    use std::time::Duration;
    let dir = std::env::temp_dir().join(format!("safe-retry-secure-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for secure in [true, false] {
        let file = dir.join(format!("{secure}.db"));
        let store = SqliteStore::builder(&format!("sqlite://{}", file.display()))
            .secure_delete(secure)
            .open()
            .await
            .unwrap();
        let claim = Claim {
            scope: "",
            key: "k",
            fingerprint: &[1; 32],
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(3600),
        };
        let claimed = store.try_claim(&claim).await.unwrap().unwrap();
        let saved = b"authorization: Bearer secret-token-31337".repeat(64);
        let point = StepWrite {
            point: "charge:started",
            steps: None,
            request: Some(&saved),
            lease: Duration::from_secs(30),
        };
        store
            .commit_step(None, claimed.fence, &point)
            .await
            .unwrap();
        let answer = StoredAnswer {
            status: http::StatusCode::CREATED,
            headers: vec![],
            body: None,
        };
        store.complete(None, claimed.fence, &answer).await.unwrap();
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(store.pool())
            .await
            .unwrap();
        store.pool().close().await;
        let bytes = std::fs::read(&file).unwrap();
        let left = bytes
            .windows(b"secret-token-31337".len())
            .any(|w| w == b"secret-token-31337");
        assert_eq!(
            left, !secure,
            "secure_delete {secure}: the cleared bytes left in the file: {left}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
