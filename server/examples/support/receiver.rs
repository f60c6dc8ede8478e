//! A dependency on loopback that dedupes on `Idempotency-Key`, as a payment provider or a
//! webhook receiver does, and counts its effects per key: what the crash tests and the
//! example's walk-through read.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;

/// The receiver's state: what it did, and the switches a test turns.
pub struct Receiver {
    /// The answer given for each key, sent again to a repeat.
    answers: Mutex<HashMap<String, (StatusCode, String)>>,
    /// Every effect performed: (key, body), in order.
    effects: Mutex<Vec<(String, String)>>,
    /// Requests received, repeats and refusals included.
    pub calls: AtomicUsize,
    /// Requests served (an effect performed, or its answer sent again): neither refused while
    /// down nor refused by `refuse_with`.
    pub served: AtomicUsize,
    /// While set, every request is answered 503 before anything is done.
    pub down: AtomicBool,
    /// While not 0, every request is answered with this status before anything is done.
    pub refuse_with: AtomicU16,
    /// While set, a request that performs an effect is not answered: it waits for ever after
    /// the effect (the caller dies or gives up first).
    pub hold: AtomicBool,
    /// A permit for each effect performed under `hold`.
    pub held: Semaphore,
    /// While set, every request that gets this far (an effect performed or its answer sent
    /// again) adds a permit to `arrived`, then waits for one of `pass` before it is answered:
    /// a test lets the callers through one at a time, in the order they came.
    pub gate: AtomicBool,
    /// A permit for each request that reached the gate.
    pub arrived: Semaphore,
    /// The permits a test gives to let requests through the gate.
    pub pass: Semaphore,
    /// The prefix of the ids it gives (`ch`, `rc`).
    prefix: &'static str,
}

impl Receiver {
    /// Starts a receiver on loopback; every `POST` path is one endpoint.
    pub async fn start(prefix: &'static str) -> (SocketAddr, Arc<Receiver>) {
        let receiver = Arc::new(Receiver {
            answers: Mutex::default(),
            effects: Mutex::default(),
            calls: AtomicUsize::new(0),
            served: AtomicUsize::new(0),
            down: AtomicBool::new(false),
            refuse_with: AtomicU16::new(0),
            hold: AtomicBool::new(false),
            held: Semaphore::new(0),
            gate: AtomicBool::new(false),
            arrived: Semaphore::new(0),
            pass: Semaphore::new(0),
            prefix,
        });
        let app = Router::new()
            .fallback(axum::routing::post(receive))
            .with_state(receiver.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let addr = listener.local_addr().expect("a bound address");
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        (addr, receiver)
    }

    /// The effects performed under `key`.
    pub fn effects_of(&self, key: &str) -> usize {
        lock(&self.effects).iter().filter(|(k, _)| k == key).count()
    }

    /// Every effect: (key, body).
    pub fn effects(&self) -> Vec<(String, String)> {
        lock(&self.effects).clone()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn receive(
    State(receiver): State<Arc<Receiver>>,
    headers: HeaderMap,
    body: String,
) -> Response {
    receiver.calls.fetch_add(1, Ordering::SeqCst);
    if receiver.down.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "down for a while").into_response();
    }
    let refuse = receiver.refuse_with.load(Ordering::SeqCst);
    if let Ok(status) = StatusCode::from_u16(refuse) {
        return (status, "refused before anything was done").into_response();
    }
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return (StatusCode::BAD_REQUEST, "an Idempotency-Key is required").into_response();
    };
    receiver.served.fetch_add(1, Ordering::SeqCst);
    let replayed = lock(&receiver.answers).get(&key).cloned();
    if let Some((status, body)) = replayed {
        gate(&receiver).await;
        return (status, [("idempotent-replayed", "true")], body).into_response();
    }
    let answer = {
        let mut answers = lock(&receiver.answers);
        if let Some((status, body)) = answers.get(&key) {
            return (*status, [("idempotent-replayed", "true")], body.clone()).into_response();
        }
        let mut effects = lock(&receiver.effects);
        effects.push((key.clone(), body));
        let answer = (
            StatusCode::CREATED,
            serde_json::json!({ "id": format!("{}_{}", receiver.prefix, effects.len()) })
                .to_string(),
        );
        answers.insert(key, answer.clone());
        answer
    };
    if receiver.hold.load(Ordering::SeqCst) {
        receiver.held.add_permits(1);
        std::future::pending::<()>().await;
    }
    gate(&receiver).await;
    answer.into_response()
}

/// Waits at the gate while it is set, saying so first.
async fn gate(receiver: &Receiver) {
    if receiver.gate.load(Ordering::SeqCst) {
        receiver.arrived.add_permits(1);
        if let Ok(permit) = receiver.pass.acquire().await {
            permit.forget();
        }
    }
}
