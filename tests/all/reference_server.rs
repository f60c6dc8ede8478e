//! The server half of the idempotency-key pattern, so the client's guarantee can be proved
//! against it, with a lossy link in front that loses requests and responses on purpose.
//!
//! `POST /orders` creates an order: one *effect*. For each `(caller, key)` the server:
//! claims the key atomically (one lock around "look up, then insert"), fingerprints the request
//! (method, path, body), answers `409` while the first copy is in progress, `422` to the same key
//! with another request, `400` to a request without a key, and replays the completed response
//! byte for byte (plus `idempotent-replayed: true`) to every later copy.

use std::collections::HashMap;
use std::collections::hash_map::{DefaultHasher, Entry};
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::support::{self, ParsedRequest};

/// What the link between client and server loses.
#[derive(Debug, Clone, Copy)]
pub enum Link {
    /// Nothing.
    Clean,
    /// The response to the first `n` copies of every key, after the server handled them.
    DropFirstResponses(u32),
    /// At random, seeded: per copy of a key, the request before the server sees it (with
    /// probability `drop_request`), or else the response after the server handled it
    /// (`drop_response`).
    /// The draw depends only on the seed, the key and the copy's number, so a run is reproducible
    /// however the copies interleave.
    Random {
        seed: u64,
        drop_request: f64,
        drop_response: f64,
    },
}

/// One request as the server received it.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub key: Option<Vec<u8>>,
    /// What happened to it: the status sent, or what the link did.
    pub fate: Fate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Answered(u16),
    RequestLost,
    ResponseLost,
}

/// An effect the server performed: an order it created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    pub caller: String,
    pub key: Vec<u8>,
    pub order: usize,
}

#[derive(Debug)]
enum Claim {
    InProgress { fingerprint: u64 },
    Completed { fingerprint: u64, response: Vec<u8> },
}

#[derive(Debug)]
struct Inner {
    link: Link,
    claims: Mutex<HashMap<(String, Vec<u8>), Claim>>,
    copies: Mutex<HashMap<Vec<u8>, u32>>,
    effects: Mutex<Vec<Effect>>,
    arrivals: Mutex<Vec<Arrival>>,
    conflicts: AtomicUsize,
    /// When set, an effect waits for a permit before it completes: the test decides how long
    /// the first copy stays in progress.
    gate: Option<Arc<Semaphore>>,
}

#[derive(Debug, Clone)]
pub struct ReferenceServer {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
}

impl ReferenceServer {
    pub async fn start(link: Link) -> ReferenceServer {
        Self::start_with_gate(link, None).await
    }

    pub async fn start_with_gate(link: Link, gate: Option<Arc<Semaphore>>) -> ReferenceServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = ReferenceServer {
            addr: listener.local_addr().unwrap(),
            inner: Arc::new(Inner {
                link,
                claims: Mutex::default(),
                copies: Mutex::default(),
                effects: Mutex::default(),
                arrivals: Mutex::default(),
                conflicts: AtomicUsize::new(0),
                gate,
            }),
        };
        let inner = server.inner.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let inner = inner.clone();
                tokio::spawn(async move { inner.serve(stream).await });
            }
        });
        server
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn effects(&self) -> Vec<Effect> {
        self.inner.effects.lock().unwrap().clone()
    }

    pub fn arrivals(&self) -> Vec<Arrival> {
        self.inner.arrivals.lock().unwrap().clone()
    }

    /// The keys claimed so far, in progress or completed: the requests the server has taken on.
    pub fn claims(&self) -> usize {
        self.inner.claims.lock().unwrap().len()
    }

    /// The `409 in progress` answers sent so far.
    pub fn conflicts(&self) -> usize {
        self.inner.conflicts.load(Ordering::SeqCst)
    }

    /// The completed response stored for `(caller, key)`, as first sent: the original.
    pub fn original_response(&self, caller: &str, key: &[u8]) -> Option<Vec<u8>> {
        match self
            .inner
            .claims
            .lock()
            .unwrap()
            .get(&(caller.to_owned(), key.to_vec()))
        {
            Some(Claim::Completed { response, .. }) => Some(response.clone()),
            _ => None,
        }
    }
}

enum Decision {
    Act,
    Reply(Vec<u8>),
}

impl Inner {
    async fn serve(&self, mut stream: TcpStream) {
        let Some(request) = support::read_request(&mut stream).await else {
            return;
        };
        let key = request.header("idempotency-key").map(<[u8]>::to_vec);
        let (lose_request, lose_response) = self.link_draw(key.as_deref());
        if lose_request {
            self.arrive(key, Fate::RequestLost);
            support::reset(stream).await;
            return;
        }
        let decision = self.decide(&request, key.as_deref());
        let response = match decision {
            Decision::Reply(response) => response,
            Decision::Act => self.act(&request, key.as_deref().unwrap_or_default()).await,
        };
        if lose_response {
            self.arrive(key, Fate::ResponseLost);
            support::reset(stream).await;
            return;
        }
        self.arrive(key, Fate::Answered(status_of(&response)));
        let _ = stream.write_all(&response).await;
        let _ = stream.shutdown().await;
    }

    fn arrive(&self, key: Option<Vec<u8>>, fate: Fate) {
        self.arrivals.lock().unwrap().push(Arrival { key, fate });
    }

    /// Whether the link loses this copy's request, or its response.
    fn link_draw(&self, key: Option<&[u8]>) -> (bool, bool) {
        let copy = {
            let mut copies = self.copies.lock().unwrap();
            let n = copies.entry(key.unwrap_or_default().to_vec()).or_insert(0);
            *n += 1;
            *n
        };
        match self.link {
            Link::Clean => (false, false),
            Link::DropFirstResponses(n) => (false, copy <= n),
            Link::Random {
                seed,
                drop_request,
                drop_response,
            } => {
                let mut h = DefaultHasher::new();
                (seed, key, copy).hash(&mut h);
                let draw = h.finish() as f64 / u64::MAX as f64;
                (
                    draw < drop_request,
                    draw >= drop_request && draw < drop_request + drop_response,
                )
            }
        }
    }

    /// The atomic claim: one lock around looking the key up and inserting it.
    fn decide(&self, request: &ParsedRequest, key: Option<&[u8]>) -> Decision {
        let Some(key) = key else {
            return Decision::Reply(respond(
                400,
                "{\"error\":\"idempotency-key required\"}",
                &[],
            ));
        };
        let fingerprint = fingerprint(request);
        let caller = caller_of(request);
        let mut claims = self.claims.lock().unwrap();
        match claims.entry((caller, key.to_vec())) {
            Entry::Vacant(slot) => {
                slot.insert(Claim::InProgress { fingerprint });
                Decision::Act
            }
            Entry::Occupied(claim) => match claim.get() {
                Claim::InProgress { fingerprint: f } | Claim::Completed { fingerprint: f, .. }
                    if *f != fingerprint =>
                {
                    Decision::Reply(respond(
                        422,
                        "{\"error\":\"key reused with a different request\"}",
                        &[],
                    ))
                }
                Claim::InProgress { .. } => {
                    self.conflicts.fetch_add(1, Ordering::SeqCst);
                    Decision::Reply(respond(409, "{\"error\":\"request in progress\"}", &[]))
                }
                Claim::Completed { response, .. } => Decision::Reply(replayed(response)),
            },
        }
    }

    /// Performs the effect once, stores the response, and returns it.
    async fn act(&self, request: &ParsedRequest, key: &[u8]) -> Vec<u8> {
        if let Some(gate) = &self.gate {
            gate.acquire().await.unwrap().forget();
        }
        let caller = caller_of(request);
        let order = {
            let mut effects = self.effects.lock().unwrap();
            let order = effects.len() + 1;
            effects.push(Effect {
                caller: caller.clone(),
                key: key.to_vec(),
                order,
            });
            order
        };
        let body = format!(
            "{{\"order\":{order},\"request\":{:?}}}",
            String::from_utf8_lossy(&request.body)
        );
        let response = respond(201, &body, &[("x-order", &order.to_string())]);
        let fingerprint = fingerprint(request);
        self.claims.lock().unwrap().insert(
            (caller, key.to_vec()),
            Claim::Completed {
                fingerprint,
                response: response.clone(),
            },
        );
        response
    }
}

fn caller_of(request: &ParsedRequest) -> String {
    request.header("x-caller").map_or_else(
        || "anonymous".to_owned(),
        |c| String::from_utf8_lossy(c).into_owned(),
    )
}

fn fingerprint(request: &ParsedRequest) -> u64 {
    let mut h = DefaultHasher::new();
    (&request.method, &request.path, &request.body).hash(&mut h);
    h.finish()
}

fn respond(status: u16, body: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let reason = match status {
        201 => "Created",
        400 => "Bad Request",
        409 => "Conflict",
        422 => "Unprocessable Entity",
        _ => "Other",
    };
    let mut out = format!("HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n");
    for (name, value) in headers {
        out += &format!("{name}: {value}\r\n");
    }
    out += &format!(
        "content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    out.into_bytes()
}

/// The stored response, byte for byte, with the replay marker after the status line.
fn replayed(original: &[u8]) -> Vec<u8> {
    let line_end = original.iter().position(|b| *b == b'\n').unwrap() + 1;
    let mut out = original[..line_end].to_vec();
    out.extend_from_slice(b"idempotent-replayed: true\r\n");
    out.extend_from_slice(&original[line_end..]);
    out
}

fn status_of(response: &[u8]) -> u16 {
    std::str::from_utf8(&response[9..12])
        .unwrap()
        .parse()
        .unwrap()
}

/// Splits a raw response into its status, headers (lowercased names) and body.
pub fn parse_response(raw: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let headers = head
        .lines()
        .skip(1)
        .map(|l| {
            let (n, v) = l.split_once(':').unwrap();
            (n.to_ascii_lowercase(), v.trim().to_owned())
        })
        .collect();
    (status_of(raw), headers, body.as_bytes().to_vec())
}
