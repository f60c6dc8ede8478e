//! gRPC retries for a tonic client, as gRFC A6 says: a payment call survives two
//! `UNAVAILABLE`s and a server's pushback, under one idempotency key.
//!
//! The server, a real tonic server on loopback, answers `payments.Ledger/Charge` with
//! `UNAVAILABLE` twice (the second time asking the client to wait 250 ms), then takes the
//! charge, once per idempotency key. The client is tonic's own, its channel under
//! `GrpcRetryLayer`; the method's retry policy is read from a gRPC service config, and the
//! method is marked non-idempotent, so every attempt carries the same key in its metadata.
//! The server prints what it answers each call; the layer's observer prints each wait it
//! decides (A6's jittered backoff, drawn from a seeded source here so it is the same on every
//! run, or the server's pushback).
//!
//! Run it with `cargo run --example grpc --features grpc`.

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::PathAndQuery;
use reqwest_safe_retry::{
    RetryRecord, SeededRng,
    grpc::{GrpcConfig, GrpcRetryLayer},
};
use tonic::{Code, Status};
use tower_layer::Layer;

/// The one message, written as prost derives it (no protoc needed).
#[derive(Clone, PartialEq, prost::Message)]
struct Charge {
    #[prost(string, tag = "1")]
    order: String,
}

/// The service's retry policy, as a gRPC service config gives it.
const SERVICE_CONFIG: &str = r#"{
  "methodConfig": [{
    "name": [{"service": "payments.Ledger"}],
    "retryPolicy": {
      "maxAttempts": 4,
      "initialBackoff": "0.1s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }],
  "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
}"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let ledger = Ledger::default();
    let uri = serve(ledger.clone()).await?;

    let config = GrpcConfig::from_json(SERVICE_CONFIG)?.non_idempotent("payments.Ledger/Charge")?;
    let channel = tonic::transport::Endpoint::from_shared(uri)?.connect_lazy();
    let layer = GrpcRetryLayer::new(config)
        .with_rng(SeededRng::new(42))
        .with_observer(|event| match (event.delay, event.retry_after) {
            (Some(delay), Some(_)) => {
                println!("  client: waiting {} (the server's pushback)", ms(delay))
            }
            (Some(delay), None) => println!("  client: waiting {} (backoff)", ms(delay)),
            _ => {}
        });
    let mut client = tonic::client::Grpc::new(layer.layer(channel));

    client.ready().await?;
    let path = PathAndQuery::from_static("/payments.Ledger/Charge");
    let request = tonic::Request::new(Charge {
        order: "order-17".into(),
    });
    let codec = tonic_prost::ProstCodec::<Charge, Charge>::default();
    let response = client.unary(request, path, codec).await?;

    let record = response
        .extensions()
        .get::<RetryRecord>()
        .expect("the layer's answers carry a record");
    println!(
        "charged {} after {} attempts ({})",
        response.get_ref().order,
        record.attempts(),
        record.stop_reason(),
    );
    let keys: HashSet<String> = ledger.keys.lock().unwrap().iter().cloned().collect();
    println!(
        "the server saw {} calls under {} idempotency key",
        ledger.calls(),
        keys.len()
    );
    println!("charges made: {}", ledger.charged.lock().unwrap().len());
    Ok(())
}

/// The server's state: each call's key, and the keys it charged under.
#[derive(Clone, Default)]
struct Ledger {
    keys: Arc<Mutex<Vec<String>>>,
    charged: Arc<Mutex<HashSet<String>>>,
}

impl Ledger {
    fn calls(&self) -> usize {
        self.keys.lock().unwrap().len()
    }
}

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl tower_service::Service<http::Request<tonic::body::Body>> for Ledger {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Boxed<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let ledger = self.clone();
        Box::pin(async move {
            let key = request
                .headers()
                .get("idempotency-key")
                .and_then(|k| k.to_str().ok())
                .unwrap_or("")
                .to_owned();
            ledger.keys.lock().unwrap().push(key.clone());
            let codec = tonic_prost::ProstCodec::<Charge, Charge>::default();
            let charge = ChargeOnce { ledger, key };
            Ok(tonic::server::Grpc::new(codec).unary(charge, request).await)
        })
    }
}

/// `Charge`: refused twice (the second time with a pushback), then made once per key.
struct ChargeOnce {
    ledger: Ledger,
    key: String,
}

impl tonic::server::UnaryService<Charge> for ChargeOnce {
    type Response = Charge;
    type Future = Boxed<Result<tonic::Response<Charge>, Status>>;

    fn call(&mut self, request: tonic::Request<Charge>) -> Self::Future {
        let (ledger, key) = (self.ledger.clone(), self.key.clone());
        Box::pin(async move {
            let call = ledger.calls();
            match call {
                1 => {
                    println!("server: call 1: UNAVAILABLE (warming up)");
                    return Err(Status::new(Code::Unavailable, "warming up"));
                }
                2 => {
                    println!("server: call 2: UNAVAILABLE, grpc-retry-pushback-ms: 250");
                    let mut busy = Status::new(Code::Unavailable, "busy");
                    busy.metadata_mut()
                        .insert("grpc-retry-pushback-ms", "250".parse().unwrap());
                    return Err(busy);
                }
                _ => {}
            }
            let new = ledger.charged.lock().unwrap().insert(key);
            println!(
                "server: call {call}: OK, {}",
                if new {
                    "charged"
                } else {
                    "a charge already made under this key"
                }
            );
            Ok(tonic::Response::new(request.into_inner()))
        })
    }
}

/// A tonic server for `ledger` on 127.0.0.1, and its URI.
async fn serve(ledger: Ledger) -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(tonic::transport::Server::builder().serve_with_incoming(ledger, incoming));
    Ok(format!("http://{address}"))
}

/// A duration as a person reads it: milliseconds, to a tenth.
fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}
