//! The gRPC clients under comparison: a tonic server on loopback answering one unary method,
//! and a tonic client over the same `Channel`, bare and under four retrying layers.
//!
//! | client | what it is |
//! |---|---|
//! | (G0) | tonic's `Channel`, bare |
//! | (G1) | tower's retry over the channel as a user writes it for tonic: the request's body read into memory (tonic's body cannot be cloned), a policy that retries a trailers-only `UNAVAILABLE` up to 2 times from a `TpsBudget` |
//! | (G1t) | (G1) under tower's `Timeout` of 10 s: a deadline over the attempts, as the layer keeps |
//! | (G2) | this crate's `GrpcRetryLayer` over the channel: A6's policy for the method (4 attempts, `UNAVAILABLE`), a budget, no key |
//! | (G3) | (G2) with the method marked non-idempotent: an idempotency key in every call's metadata |

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http_body_util::{BodyExt, Full};
use reqwest_safe_retry::grpc::{GrpcConfig, GrpcRetryLayer, GrpcRetryPolicy};
use tonic::{Code, Status};

use crate::Client;

/// The one message: the order being echoed.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Order {
    #[prost(string, tag = "1")]
    pub id: String,
}

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

#[derive(Clone)]
struct Echo;

impl tower::Service<http::Request<tonic::body::Body>> for Echo {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Boxed<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<Order, Order>::default();
            Ok(tonic::server::Grpc::new(codec).unary(Place, request).await)
        })
    }
}

struct Place;

impl tonic::server::UnaryService<Order> for Place {
    type Response = Order;
    type Future = std::future::Ready<Result<tonic::Response<Order>, Status>>;

    fn call(&mut self, request: tonic::Request<Order>) -> Self::Future {
        std::future::ready(Ok(tonic::Response::new(request.into_inner())))
    }
}

/// Starts a tonic server on 127.0.0.1 on the current runtime; returns its address.
pub async fn start_grpc() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(tonic::transport::Server::builder().serve_with_incoming(Echo, incoming));
    address
}

/// Starts the same server on a thread and runtime of its own, which run until the process
/// ends: for measurements of the client's side alone.
pub fn start_grpc_on_own_thread() -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            tx.send(start_grpc().await).unwrap();
            std::future::pending::<()>().await;
        });
    });
    rx.recv().unwrap()
}

/// The gRPC clients, each with its label.
pub fn grpc_clients() -> Vec<crate::Labelled> {
    vec![
        ("(G0) tonic Channel", || grpc_client(|channel| channel)),
        ("(G1) tower retry + TpsBudget", || {
            grpc_client(|channel| Buffered(tower_retry(channel)))
        }),
        ("(G2) GrpcRetryLayer", || {
            grpc_client(|channel| tower::Layer::layer(&GrpcRetryLayer::new(config(false)), channel))
        }),
        ("(G3) GrpcRetryLayer, key", || {
            grpc_client(|channel| tower::Layer::layer(&GrpcRetryLayer::new(config(true)), channel))
        }),
        ("(G1t) tower retry + TpsBudget + timeout", || {
            grpc_client(|channel| {
                // A deadline over the attempts, as the layer keeps one: tower's timeout.
                let retry = tower_retry(channel);
                Buffered(tower::timeout::Timeout::new(retry, Duration::from_secs(10)))
            })
        }),
    ]
}

/// `channel` taking the requests tower's retry makes (a body in memory) as tonic's.
type ToTonic<S> =
    tower::util::MapRequest<S, fn(http::Request<Full<Bytes>>) -> http::Request<tonic::body::Body>>;

/// tower's retry over `channel` as a user writes it for tonic: a trailers-only `UNAVAILABLE`
/// or an error retried up to 2 times from a `TpsBudget`, over the body read into memory.
fn tower_retry<S>(channel: S) -> tower::retry::Retry<Unavailable, ToTonic<S>> {
    let budget = Arc::new(tower::retry::budget::TpsBudget::new(
        Duration::from_secs(10),
        10,
        0.2,
    ));
    let to_tonic: fn(http::Request<Full<Bytes>>) -> http::Request<tonic::body::Body> =
        |r| r.map(tonic::body::Body::new);
    tower::retry::Retry::new(
        Unavailable { left: 2, budget },
        tower::util::MapRequest::new(channel, to_tonic),
    )
}

fn config(keyed: bool) -> GrpcConfig {
    let policy = GrpcRetryPolicy::builder()
        .max_attempts(4)
        .initial_backoff(Duration::from_millis(100))
        .max_backoff(Duration::from_secs(1))
        .retryable_codes([Code::Unavailable])
        .build()
        .unwrap();
    let config = GrpcConfig::new().retry("bench.Orders", policy).unwrap();
    if keyed {
        config.non_idempotent("bench.Orders/Place").unwrap()
    } else {
        config
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A client that calls `bench.Orders/Place` through `wrap(channel)`, the channel made on the
/// first call, to the URL's address.
fn grpc_client<S, F>(wrap: F) -> Client
where
    F: Fn(tonic::transport::Channel) -> S + Send + Sync + 'static,
    S: tonic::client::GrpcService<tonic::body::Body> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    S::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <S::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
{
    let service: Arc<OnceLock<S>> = Arc::new(OnceLock::new());
    let wrap = Arc::new(wrap);
    Client::Tower(Arc::new(move |url: &str| {
        let service = service
            .get_or_init(|| {
                let origin = url.trim_end_matches("/orders").to_owned();
                let channel = tonic::transport::Endpoint::from_shared(origin)
                    .unwrap()
                    .connect_lazy();
                wrap(channel)
            })
            .clone();
        Box::pin(async move {
            let mut grpc = tonic::client::Grpc::new(service);
            grpc.ready().await.map_err(Into::into).unwrap();
            let path = PathAndQuery::from_static("/bench.Orders/Place");
            let request = tonic::Request::new(Order {
                id: "order-42".into(),
            });
            let codec = tonic_prost::ProstCodec::<Order, Order>::default();
            match grpc.unary(request, path, codec).await {
                Ok(_) => 200,
                Err(status) => panic!("{status:?}"),
            }
        })
    }))
}

/// tower's retry for tonic as a user writes one: the body read into memory first, since
/// tonic's body cannot be cloned.
#[derive(Clone)]
struct Buffered<S>(S);

impl<S, R> tower::Service<http::Request<tonic::body::Body>> for Buffered<S>
where
    S: tower::Service<http::Request<Full<Bytes>>, Response = http::Response<R>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    type Response = http::Response<R>;
    type Error = BoxError;
    type Future = Boxed<Result<http::Response<R>, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let mut inner = self.0.clone();
        std::mem::swap(&mut inner, &mut self.0);
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = body.collect().await?.to_bytes();
            let request = http::Request::from_parts(parts, Full::new(bytes));
            inner.call(request).await.map_err(Into::into)
        })
    }
}

/// Retries a trailers-only `UNAVAILABLE` or an error up to `left` times, each paid from a TPS
/// budget that every answer deposits into.
#[derive(Clone)]
struct Unavailable {
    left: usize,
    budget: Arc<tower::retry::budget::TpsBudget>,
}

impl<Res, E> tower::retry::Policy<http::Request<Full<Bytes>>, http::Response<Res>, E>
    for Unavailable
{
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _: &mut http::Request<Full<Bytes>>,
        result: &mut Result<http::Response<Res>, E>,
    ) -> Option<Self::Future> {
        let failed = match result {
            Ok(response) => response
                .headers()
                .get("grpc-status")
                .is_some_and(|code| code == "14"),
            Err(_) => true,
        };
        crate::paid_retry(failed, &mut self.left, &self.budget)
    }

    fn clone_request(
        &mut self,
        request: &http::Request<Full<Bytes>>,
    ) -> Option<http::Request<Full<Bytes>>> {
        Some(crate::copy_of(request))
    }
}
