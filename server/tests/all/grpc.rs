//! The gRPC front on every store: a tonic server (`examples/support/bank.rs`) behind the layer
//! on loopback, called over HTTP/2 as tonic's own client calls it, each answer read whole —
//! head, messages and trailers — and every effect counted in the database and at the payment
//! provider.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::HeaderMap;
use http_body_util::BodyExt;
use prost::Message as _;
use safe_retry_server::grpc::GrpcIdempotencyLayer;
use safe_retry_server::{Builder, IdempotencyLayer, Relay};
use tower_service::Service;

use crate::bank::{BALANCE, BATCH, Bank, CHARGE, Charge, Receipt, STATEMENT, Served, serve};
use crate::grpc_halves::Halves;
use crate::lossy_link::Fate;
use crate::orders_app::{Crash, Faults, Orders};
use crate::receiver::Receiver;
use crate::steps::{downstream_client, reached};
use crate::support::Backend;

/// The bank behind the layer, its dependencies, and a channel to it.
pub struct World<S: Backend> {
    pub store: S,
    pub layer: GrpcIdempotencyLayer<S>,
    pub bank: Bank<S>,
    /// Serving while the world lives.
    _server: Served,
    pub payments: Arc<Receiver>,
    pub receipts: Arc<Receiver>,
    pub faults: Arc<Faults>,
    pub channel: tonic::transport::Channel,
}

impl<S: Backend> World<S> {
    pub async fn new(configure: impl FnOnce(Builder<S>) -> Builder<S>) -> World<S> {
        let store = S::fresh().await;
        let builder = IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .grpc_method(CHARGE)
            .grpc_method(STATEMENT)
            .grpc_method(BATCH);
        let layer = configure(builder).build_grpc().unwrap();
        let (payments_addr, payments) = Receiver::start("ch").await;
        let (receipts_addr, receipts) = Receiver::start("rc").await;
        let faults = Arc::new(Faults::default());
        let bank = Bank::new(Orders {
            client: downstream_client(Duration::from_secs(5)),
            payments: format!("http://{payments_addr}"),
            receipts: format!("http://{receipts_addr}"),
            faults: faults.clone(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = serve(layer.clone(), bank.clone(), listener);
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        World {
            store,
            layer,
            bank,
            _server: server,
            payments,
            receipts,
            faults,
            channel,
        }
    }

    /// Calls `path` with `charge`, under `key`, and reads the answer whole.
    pub async fn call(&self, path: &str, key: Option<&str>, charge: &Charge) -> Raw {
        call(self.channel.clone(), path, key, charge).await
    }

    /// The order rows (the local effect) of `key`.
    pub async fn rows_of(&self, key: &str) -> usize {
        let effects = self.store.effects().await.unwrap();
        effects.iter().filter(|e| e.key == key).count()
    }
}

/// A gRPC answer read whole.
#[derive(Debug, Clone)]
pub struct Raw {
    pub headers: HeaderMap,
    pub data: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Raw {
    /// The call's status code: from the trailers, or the head of a trailers-only answer.
    pub fn code(&self) -> tonic::Code {
        let status = self.trailers.as_ref().and_then(|t| t.get("grpc-status"));
        let status = status.or_else(|| self.headers.get("grpc-status"));
        let code = status
            .expect("a gRPC answer has a status")
            .to_str()
            .unwrap();
        tonic::Code::from_i32(code.parse().unwrap())
    }

    /// A metadata value, from the head or (for a trailers-only answer) the same place.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    /// The answer's messages.
    pub fn receipts(&self) -> Vec<Receipt> {
        let mut data = self.data.clone();
        let mut out = Vec::new();
        while data.has_remaining() {
            assert_eq!(data.get_u8(), 0, "uncompressed");
            let len = data.get_u32() as usize;
            out.push(Receipt::decode(data.split_to(len)).unwrap());
        }
        out
    }

    /// The head without what differs between two sends of one answer: the date, and the
    /// replay's own marker.
    pub fn unmarked_headers(&self) -> HeaderMap {
        let mut headers = self.headers.clone();
        headers.remove("date");
        headers.remove("idempotent-replayed");
        headers
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// One call with a stream of `charges`, read whole.
pub async fn call_streaming(
    mut channel: tonic::transport::Channel,
    path: &str,
    key: &str,
    charges: &[Charge],
) -> Raw {
    let mut framed = BytesMut::new();
    for charge in charges {
        framed.put_u8(0);
        framed.put_u32(charge.encoded_len() as u32);
        charge.encode(&mut framed).unwrap();
    }
    let request = http::Request::post(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(tonic::body::Body::new(http_body_util::Full::new(
            framed.freeze(),
        )))
        .unwrap();
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .unwrap();
    let (head, body) = channel.call(request).await.unwrap().into_parts();
    let collected = body.collect().await.unwrap();
    Raw {
        headers: head.headers,
        trailers: collected.trailers().cloned(),
        data: collected.to_bytes(),
    }
}

/// One call over `channel`, as tonic's generated client makes it, read whole.
pub async fn call(
    channel: tonic::transport::Channel,
    path: &str,
    key: Option<&str>,
    charge: &Charge,
) -> Raw {
    try_call(channel, path, key, charge).await.unwrap()
}

/// One call, or the transport's error.
pub async fn try_call(
    mut channel: tonic::transport::Channel,
    path: &str,
    key: Option<&str>,
    charge: &Charge,
) -> Result<Raw, Box<dyn std::error::Error + Send + Sync>> {
    let mut framed = BytesMut::new();
    framed.put_u8(0);
    framed.put_u32(charge.encoded_len() as u32);
    charge.encode(&mut framed).unwrap();
    let mut request = http::Request::post(path)
        .header("content-type", "application/grpc")
        .header("grpc-accept-encoding", "identity")
        .header("te", "trailers");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let body = tonic::body::Body::new(http_body_util::Full::new(framed.freeze()));
    let request = request.body(body).unwrap();
    std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
    let answer = channel.call(request).await?;
    let (head, body) = answer.into_parts();
    let collected = body.collect().await?;
    Ok(Raw {
        headers: head.headers,
        trailers: collected.trailers().cloned(),
        data: collected.to_bytes(),
    })
}

fn charge(item: &str) -> Charge {
    Charge {
        item: item.into(),
        cents: 1000,
    }
}

/// The same key twice: one order row, one charge at the provider, one receipt staged; the
/// second answer is the first byte for byte — head, message and trailers — marked a replay. A
/// streamed answer whose status carries metadata in its trailers comes back whole too, and a
/// client stream counts as one call.
pub async fn grpc_the_same_key_twice_is_one_charge_and_one_answer_trailers_and_all<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    let first = world.call(CHARGE, Some("k-1"), &charge("tea")).await;
    assert_eq!(first.code(), tonic::Code::Ok, "{first:?}");
    assert!(!first.replayed());
    let receipt = first.receipts();
    assert_eq!(receipt.len(), 1);
    assert_eq!(
        first.header("x-order"),
        Some(&*receipt[0].order.to_string())
    );
    let again = world.call(CHARGE, Some("k-1"), &charge("tea")).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.unmarked_headers(), first.unmarked_headers());
    assert_eq!(again.data, first.data);
    assert_eq!(again.trailers, first.trailers);
    assert_eq!(world.rows_of("k-1").await, 1);
    assert_eq!(world.payments.effects().len(), 1);
    assert_eq!(world.store.outbox().await.unwrap().len(), 1);

    let streamed = world.call(STATEMENT, Some("s-1"), &charge("tea")).await;
    assert_eq!(streamed.receipts().len(), 2);
    assert_eq!(streamed.code(), tonic::Code::OutOfRange);
    let trailers = streamed
        .trailers
        .clone()
        .expect("a streamed answer ends in trailers");
    assert_eq!(
        trailers.get("x-balance").unwrap(),
        &*streamed.receipts()[0].order.to_string()
    );
    let again = world.call(STATEMENT, Some("s-1"), &charge("tea")).await;
    assert!(again.replayed());
    assert_eq!(
        (again.unmarked_headers(), &again.data, &again.trailers),
        (
            streamed.unmarked_headers(),
            &streamed.data,
            &streamed.trailers
        )
    );
    assert_eq!(world.rows_of("s-1").await, 1);

    // A client stream is read whole before the handler runs: one effect for the batch, and the
    // same batch again is its answer again; another batch under the key is refused.
    let batch = [charge("tea"), charge("cake")];
    let summed = call_streaming(world.channel.clone(), BATCH, "b-1", &batch).await;
    assert_eq!(summed.code(), tonic::Code::Ok, "{summed:?}");
    assert_eq!(summed.receipts()[0].charge, "2000 cents");
    let again = call_streaming(world.channel.clone(), BATCH, "b-1", &batch).await;
    assert!(again.replayed());
    assert_eq!(
        (&again.data, &again.trailers),
        (&summed.data, &summed.trailers)
    );
    let other = call_streaming(world.channel.clone(), BATCH, "b-1", &batch[..1]).await;
    assert_eq!(other.header("safe-retry-problem"), Some("key-reused"));
    assert_eq!(world.rows_of("b-1").await, 1);
    let counters = world.layer.counters().snapshot();
    assert_eq!((counters.completions, counters.replays), (3, 3));
}

/// 32 copies of one call at once: one order row and one charge; every answer is the first's
/// message (the one that ran, or a replay of it) or the in-progress answer, `UNAVAILABLE` with a
/// pushback an A6 client waits out.
pub async fn grpc_32_copies_at_once_are_one_charge<S: Backend>() {
    let world = World::<S>::new(|b| b.in_progress_retry_after(Duration::from_millis(250))).await;
    let copies: Vec<_> = (0..32)
        .map(|_| {
            let channel = world.channel.clone();
            tokio::spawn(async move { call(channel, CHARGE, Some("k-32"), &charge("tea")).await })
        })
        .collect();
    let mut answers = Vec::new();
    for copy in copies {
        answers.push(copy.await.unwrap());
    }
    assert_eq!(world.rows_of("k-32").await, 1);
    assert_eq!(world.payments.effects().len(), 1);
    let ran: Vec<&Raw> = answers
        .iter()
        .filter(|a| a.code() == tonic::Code::Ok && !a.replayed())
        .collect();
    assert_eq!(ran.len(), 1, "one copy ran");
    for answer in &answers {
        match answer.code() {
            tonic::Code::Ok => assert_eq!(answer.data, ran[0].data),
            tonic::Code::Unavailable => {
                assert_eq!(answer.header("safe-retry-problem"), Some("in-progress"));
                assert_eq!(answer.header("grpc-retry-pushback-ms"), Some("250"));
            }
            other => panic!("{other:?}: {answer:?}"),
        }
    }
}

/// The same key with another call is refused for good: `FAILED_PRECONDITION` with a pushback
/// of -1 (never retry), and nothing runs. A call without its key, or with a malformed one, is
/// refused the same way; a method the layer does not guard runs every time.
pub async fn grpc_another_call_under_a_key_is_refused_and_never_retried<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    assert_eq!(
        world.call(CHARGE, Some("k-2"), &charge("tea")).await.code(),
        tonic::Code::Ok
    );
    let other = world.call(CHARGE, Some("k-2"), &charge("coffee")).await;
    assert_eq!(other.code(), tonic::Code::FailedPrecondition, "{other:?}");
    assert_eq!(other.header("safe-retry-problem"), Some("key-reused"));
    assert_eq!(other.header("grpc-retry-pushback-ms"), Some("-1"));
    assert!(
        other.data.is_empty() && other.trailers.is_none(),
        "trailers-only"
    );
    let missing = world.call(CHARGE, None, &charge("tea")).await;
    assert_eq!(missing.code(), tonic::Code::InvalidArgument);
    assert_eq!(missing.header("safe-retry-problem"), Some("missing-key"));
    assert_eq!(missing.header("grpc-retry-pushback-ms"), Some("-1"));
    let malformed = world.call(CHARGE, Some("\"open"), &charge("tea")).await;
    assert_eq!(
        malformed.header("safe-retry-problem"),
        Some("malformed-key")
    );
    assert_eq!(world.rows_of("k-2").await, 1);
    assert_eq!(world.store.effects().await.unwrap().len(), 1);
    assert_eq!(world.payments.effects().len(), 1);
    for _ in 0..2 {
        let balance = world.call(BALANCE, None, &charge("tea")).await;
        assert_eq!(balance.code(), tonic::Code::Ok);
    }
    assert_eq!(world.bank.balance_calls(), 2);
    assert_eq!(
        world.store.outcomes().await.len(),
        1,
        "nothing recorded for Balance"
    );
}

/// A method whose key is optional: a call without one runs unguarded every time (its handler
/// finds no execution), a call with one runs once per key.
pub async fn grpc_a_method_whose_key_is_optional_is_guarded_only_with_one<S: Backend>() {
    let world = World::<S>::new(|b| b.grpc_method_key_optional(BALANCE)).await;
    for _ in 0..2 {
        assert_eq!(
            world.call(BALANCE, None, &charge("tea")).await.code(),
            tonic::Code::Ok
        );
    }
    assert_eq!(world.bank.balance_calls(), 2);
    assert!(world.store.outcomes().await.is_empty());
    let first = world.call(BALANCE, Some("b-1"), &charge("tea")).await;
    let again = world.call(BALANCE, Some("b-1"), &charge("tea")).await;
    assert!(!first.replayed() && again.replayed());
    assert_eq!(world.bank.balance_calls(), 3, "the keyed call ran once");
}

/// A call the handler refuses before doing anything ([`Rejected::grpc`]) stores nothing: the
/// corrected call under the same key runs.
pub async fn grpc_a_refusal_stores_nothing_and_the_corrected_call_runs<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    let refused = Charge {
        item: "tea".into(),
        cents: 0,
    };
    let answer = world.call(CHARGE, Some("k-3"), &refused).await;
    assert_eq!(answer.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        answer.header("safe-retry-mark"),
        None,
        "the mark never leaves"
    );
    assert!(world.store.outcomes().await.is_empty());
    let corrected = world.call(CHARGE, Some("k-3"), &charge("tea")).await;
    assert_eq!(corrected.code(), tonic::Code::Ok);
    assert!(!corrected.replayed());
    assert_eq!(world.rows_of("k-3").await, 1);
}

/// The rest of the table, each by its rule: messages over the limit, no caller to scope to, an
/// answer too large to store (sent whole, replayed as `DATA_LOSS`), a record started too often
/// (`ABORTED gave-up`, stored and replayed), and a handler's status: an outcome, unless named in
/// `grpc_not_stored`.
pub async fn grpc_limits_and_failures_answer_by_the_table<S: Backend>() {
    let negative = Charge {
        item: "tea".into(),
        cents: -5,
    };
    let world = World::<S>::new(|b| b.max_request_body(8)).await;
    let large = world
        .call(CHARGE, Some("k-big"), &charge("a long item name"))
        .await;
    assert_eq!(large.code(), tonic::Code::ResourceExhausted);
    assert_eq!(large.header("safe-retry-problem"), Some("body-too-large"));
    assert_eq!(large.header("grpc-retry-pushback-ms"), Some("-1"));
    assert!(world.store.outcomes().await.is_empty());

    let world = World::<S>::new(|b| {
        b.scope(|parts| {
            let caller = parts.headers.get("x-caller")?;
            caller.to_str().ok().map(str::to_owned)
        })
    })
    .await;
    let nobody = world.call(CHARGE, Some("k-1"), &charge("tea")).await;
    assert_eq!(nobody.code(), tonic::Code::Unauthenticated);
    assert_eq!(nobody.header("safe-retry-problem"), Some("no-scope"));

    let world = World::<S>::new(|b| {
        b.max_answer_body(4)
            .grpc_not_stored([tonic::Code::InvalidArgument])
    })
    .await;
    let first = world.call(CHARGE, Some("k-big"), &charge("tea")).await;
    assert_eq!(first.code(), tonic::Code::Ok);
    assert_eq!(first.receipts().len(), 1, "sent whole");
    let replay = world.call(CHARGE, Some("k-big"), &charge("tea")).await;
    assert_eq!(replay.code(), tonic::Code::DataLoss);
    assert_eq!(
        replay.header("safe-retry-problem"),
        Some("answer-not-stored")
    );
    assert!(replay.replayed());
    assert_eq!(world.rows_of("k-big").await, 1);
    let unstored = world.call(CHARGE, Some("k-neg"), &negative).await;
    assert_eq!(unstored.code(), tonic::Code::InvalidArgument);
    let again = world.call(CHARGE, Some("k-neg"), &negative).await;
    assert!(
        !again.replayed(),
        "a code in grpc_not_stored is never stored"
    );
    let outcomes = world.store.outcomes().await;
    let neg = outcomes.iter().find(|(key, _, _)| key == "k-neg").unwrap();
    assert_eq!(
        neg.1, "in_progress",
        "not completed: its lease ended for the retry"
    );

    let world = World::<S>::new(|b| b.max_attempts(1)).await;
    world.faults.arm("after-order", Crash::Fail);
    let failed = world.call(CHARGE, Some("k-up"), &charge("tea")).await;
    assert_eq!(failed.code(), tonic::Code::Unavailable);
    assert_eq!(
        failed.header("safe-retry-problem"),
        Some("store-unavailable")
    );
    assert_eq!(failed.header("grpc-retry-pushback-ms"), Some("1000"));
    let gave_up = world.call(CHARGE, Some("k-up"), &charge("tea")).await;
    assert_eq!(gave_up.code(), tonic::Code::Aborted, "{gave_up:?}");
    assert_eq!(gave_up.header("safe-retry-problem"), Some("gave-up"));
    assert_eq!(gave_up.header("grpc-retry-pushback-ms"), Some("-1"));
    let still = world.call(CHARGE, Some("k-up"), &charge("tea")).await;
    assert!(still.replayed());
    assert_eq!(still.unmarked_headers(), gave_up.unmarked_headers());
    assert_eq!(world.payments.effects().len(), 0, "never charged");
    let stored = world.call(CHARGE, Some("k-neg"), &negative).await;
    assert_eq!(stored.code(), tonic::Code::InvalidArgument);
    let again = world.call(CHARGE, Some("k-neg"), &negative).await;
    assert!(again.replayed(), "a status the handler chose is an outcome");
    assert_eq!(again.unmarked_headers(), stored.unmarked_headers());
    assert_eq!(world.store.outcomes().await.len(), 2);
}

/// A call stopped after its charge (its caller gone) is finished by the gRPC layer's
/// reconciler on the saved call, from its first step not done: one charge at the provider, one
/// order row, one receipt through the relay; the caller's retry is answered the stored receipt.
pub async fn grpc_a_call_stopped_after_its_charge_is_finished_by_the_reconciler<S: Backend>() {
    let world = World::<S>::new(|b| b).await;
    world.faults.arm("after-charge-call", Crash::Hang);
    let channel = world.channel.clone();
    let stopped =
        tokio::spawn(async move { call(channel, CHARGE, Some("k-4"), &charge("tea")).await });
    reached(&world.faults).await;
    // The caller hangs up: the server drops the call, and the lease ends at once.
    stopped.abort();
    world.faults.disarm();
    for _ in 0..200 {
        let stalled = world.store.stalled(100).await.unwrap();
        if stalled.iter().any(|s| s.key == "k-4") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let saved = world
        .store
        .saved_request("k-4")
        .await
        .expect("saved at the first step");
    let has = |name: &[u8]| saved.windows(name.len()).any(|w| w == name);
    assert!(
        has(b"grpc-accept-encoding") && has(b"application/grpc"),
        "what a resumption needs"
    );
    let reconciler = world.layer.reconciler(world.bank.clone());
    let report = reconciler.tick().await.unwrap();
    assert_eq!((report.found, report.completed), (1, 1), "{report:?}");
    let relay = Relay::new(
        world.store.clone(),
        downstream_client(Duration::from_secs(5)),
    );
    assert_eq!(relay.tick().await.unwrap().sent, 1);
    let retried = world.call(CHARGE, Some("k-4"), &charge("tea")).await;
    assert_eq!(retried.code(), tonic::Code::Ok, "{retried:?}");
    assert!(retried.replayed());
    let receipt = &retried.receipts()[0];
    assert_eq!(receipt.attempt, 2, "the reconciler's start");
    assert_eq!(world.payments.effects().len(), 1, "one charge");
    assert_eq!(
        world
            .payments
            .calls
            .load(std::sync::atomic::Ordering::SeqCst),
        2
    );
    assert_eq!(world.receipts.effects().len(), 1, "one receipt");
    assert_eq!(world.rows_of("k-4").await, 1);
}

/// Crash recovery by a real kill: the bank as a process of its own (the `grpc_bank` example),
/// killed with SIGKILL once a call's charge reached the provider and before its step
/// committed; a new process on the same database finishes the call (its reconciler, or the
/// caller's retry, resumes it at the charge step, which the provider answers from its record
/// of the key). One charge, one order row, one receipt; the caller's retry gets the receipt.
pub async fn grpc_sigkill_after_the_charge_call_leaves_one_charge<S: Backend>() {
    let (payments_addr, payments) = Receiver::start("ch").await;
    let (receipts_addr, receipts) = Receiver::start("rc").await;
    let url = S::empty_database().await;
    let start = |crash: Option<&str>| {
        let mut command = tokio::process::Command::new(bank_binary());
        command
            .args(["--serve", "--database-url", &url])
            .args(["--payments-url", &format!("http://{payments_addr}")])
            .args(["--receipts-url", &format!("http://{receipts_addr}")])
            .args(["--lease-ms", "400", "--every-ms", "100"])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        if let Some(point) = crash {
            command.args(["--crash-at", point]);
        }
        command
            .spawn()
            .expect("the grpc_bank example is built beside the tests")
    };
    let mut first = start(Some("after-charge-call"));
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(first.stdout.take().unwrap()));
    let addr = listening(&mut lines).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let sent = charge("tea");
    let calling = tokio::spawn({
        let sent = sent.clone();
        async move { try_call(channel, CHARGE, Some("k-kill"), &sent).await }
    });
    until_line(&mut lines, "reached after-charge-call").await;
    first.kill().await.unwrap();
    assert!(
        calling.await.unwrap().is_err(),
        "the call died with its server"
    );
    assert_eq!(payments.effects().len(), 1, "charged before the kill");

    let mut second = start(None);
    let mut lines =
        tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(second.stdout.take().unwrap()));
    let addr = listening(&mut lines).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut answer = None;
    // The retry waits out the dead holder's lease (400 ms), bounded at 5 s.
    for _ in 0..100 {
        let retried = call(channel.clone(), CHARGE, Some("k-kill"), &sent).await;
        if retried.code() == tonic::Code::Ok {
            answer = Some(retried);
            break;
        }
        assert_eq!(
            retried.header("safe-retry-problem"),
            Some("in-progress"),
            "{retried:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = answer.expect("the call finished within 5 s");
    assert_eq!(answer.receipts().len(), 1);
    for _ in 0..100 {
        if !receipts.effects().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    second.kill().await.unwrap();
    assert_eq!(payments.effects().len(), 1, "one charge");
    assert_eq!(
        payments.calls.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "charged again under its key after the kill"
    );
    assert_eq!(receipts.effects().len(), 1, "one receipt");
    let store = S::connect_to(&url).await;
    let rows = store.effects().await.unwrap();
    assert_eq!(
        rows.iter().filter(|r| r.key == "k-kill").count(),
        1,
        "one order row"
    );
}

/// The `grpc_bank` example's binary, beside the tests'.
fn bank_binary() -> std::path::PathBuf {
    crate::walkthrough::example_binary().with_file_name("grpc_bank")
}

type Lines = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;

/// Reads the process's lines (for at most 10 s) until it says where it listens.
async fn listening(lines: &mut Lines) -> String {
    let line = until_line(lines, "listening ").await;
    line.trim_start_matches("listening ").to_owned()
}

/// Reads the process's lines (for at most 10 s) until one starts with `start`.
async fn until_line(lines: &mut Lines, start: &str) -> String {
    let found = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.starts_with(start) {
                return line;
            }
        }
        panic!("the process ended before it said {start:?}");
    });
    found
        .await
        .unwrap_or_else(|_| panic!("no {start:?} within 10 s"))
}

on_every_store!(
    grpc_the_same_key_twice_is_one_charge_and_one_answer_trailers_and_all,
    grpc_32_copies_at_once_are_one_charge,
    grpc_another_call_under_a_key_is_refused_and_never_retried,
    grpc_a_refusal_stores_nothing_and_the_corrected_call_runs,
    grpc_a_method_whose_key_is_optional_is_guarded_only_with_one,
    grpc_limits_and_failures_answer_by_the_table,
    grpc_a_call_stopped_after_its_charge_is_finished_by_the_reconciler,
    grpc_both_halves_through_a_lossy_link_charge_each_call_once,
    grpc_sigkill_after_the_charge_call_leaves_one_charge,
);

/// Both halves over gRPC: the client's gRPC door (one key per call, on every attempt) calls
/// the bank through a link that resets connections and drops answers; 200 calls, 16 at a
/// time. No charge is lost or made twice (one order row and one charge at the provider per
/// call), and every caller got its record's stored answer (the same call sent again under its
/// key is answered the receipt its caller holds, as a replay).
pub async fn grpc_both_halves_through_a_lossy_link_charge_each_call_once<S: Backend>() {
    const CALLS: usize = 200;
    let store = S::fresh().await;
    let halves = Arc::new(Halves::start(store, 0x5eed_0065).await.unwrap());
    // Bounded: a store that fails every statement leaves the callers retrying until their
    // budget ends, and the test fails instead of waiting for ever.
    let answers = tokio::time::timeout(Duration::from_secs(60), halves.charge_many(CALLS, 16))
        .await
        .expect("every call is answered within 60 s");
    let receipts: Vec<Receipt> = answers
        .into_iter()
        .enumerate()
        .map(|(i, answer)| answer.unwrap_or_else(|status| panic!("call {i} lost: {status:?}")))
        .collect();
    let rows = halves.store.effects().await.unwrap();
    assert_eq!(
        rows.len(),
        CALLS,
        "one order row per call: none lost, none twice"
    );
    let keys: std::collections::BTreeSet<&str> = rows.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys.len(), CALLS, "one key per call");
    let charges = halves.payments.effects();
    assert_eq!(charges.len(), CALLS, "one charge per call");
    let charge_keys: std::collections::BTreeSet<&str> =
        charges.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(charge_keys.len(), CALLS, "one downstream key per call");
    let mut orders: Vec<i64> = receipts.iter().map(|r| r.order).collect();
    orders.sort_unstable();
    let mut ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    assert_eq!(orders, ids, "each caller holds its own record's answer");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", halves.server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    for row in &rows {
        let sent = Charge {
            item: row.body.clone(),
            cents: 1000,
        };
        let again = call(channel.clone(), CHARGE, Some(&row.key), &sent).await;
        assert!(again.replayed(), "{again:?}");
        let stored = &again.receipts()[0];
        let held = receipts.iter().find(|r| r.order == row.id).unwrap();
        assert_eq!(stored, held, "the caller got the stored answer");
    }
    let fates = halves.link.fates.lock().unwrap().clone();
    for fate in [Fate::ResetBefore, Fate::DropAnswer, Fate::CutSoon] {
        assert!(fates.contains(&fate), "the link drew {fate:?}");
    }
    let counts = halves.layer.counters().snapshot();
    assert!(
        counts.replays > CALLS as u64,
        "answers were lost and replayed to the door's retries: {counts:?}"
    );
}
