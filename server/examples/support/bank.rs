//! A bank as a tonic service, written by hand as tonic's generated code would be (no protoc):
//!
//! - `bank.Bank/Charge` (unary, guarded): the order walk-through of the README over gRPC — an
//!   order row (a local step), a charge at a payment provider (an external step, through this
//!   workspace's client, with the key derived from the record), a receipt through the outbox;
//!   a crash point at each recovery point. A charge of no cents is refused before anything is
//!   done ([`Rejected::grpc`]), so a corrected call with the key runs; a negative charge is
//!   answered `INVALID_ARGUMENT`, an outcome like any other.
//! - `bank.Bank/Statement` (server streaming, guarded): writes an effect, then answers two
//!   messages and a final status with metadata in its trailers.
//! - `bank.Bank/Batch` (client streaming, guarded): reads every charge of the stream, writes
//!   one effect for their sum, and answers one receipt.
//! - `bank.Bank/Balance` (unary, not guarded): counts its calls.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use safe_retry_server::{Execution, Message, Rejected, Step, StepError, StoreError};
use tonic::{Code, Status};

use crate::charges_app::ChargesDb;
use crate::orders_app::Orders;

/// The guarded methods' paths.
pub const CHARGE: &str = "/bank.Bank/Charge";
/// The streaming method's path.
pub const STATEMENT: &str = "/bank.Bank/Statement";
/// The unguarded method's path.
pub const BALANCE: &str = "/bank.Bank/Balance";
/// The client-streaming method's path.
pub const BATCH: &str = "/bank.Bank/Batch";

/// A charge to make.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Charge {
    /// What is ordered.
    #[prost(string, tag = "1")]
    pub item: String,
    /// How much, in cents.
    #[prost(int64, tag = "2")]
    pub cents: i64,
}

/// What a charge made.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Receipt {
    /// The order row's id.
    #[prost(int64, tag = "1")]
    pub order: i64,
    /// The provider's charge id.
    #[prost(string, tag = "2")]
    pub charge: String,
    /// The start of the record that answered (1, or more after a takeover or resumption).
    #[prost(int64, tag = "3")]
    pub attempt: i64,
}

/// The bank: its dependencies, and what a test watches.
pub struct Bank<S> {
    orders: Orders,
    balance_calls: Arc<AtomicUsize>,
    store: std::marker::PhantomData<fn() -> S>,
}

impl<S> Clone for Bank<S> {
    fn clone(&self) -> Self {
        Bank {
            orders: self.orders.clone(),
            balance_calls: self.balance_calls.clone(),
            store: std::marker::PhantomData,
        }
    }
}

impl<S: ChargesDb> Bank<S> {
    /// A bank whose charges go to `orders`' dependencies.
    pub fn new(orders: Orders) -> Bank<S> {
        Bank {
            orders,
            balance_calls: Arc::default(),
            store: std::marker::PhantomData,
        }
    }

    /// How many times `Balance` ran.
    pub fn balance_calls(&self) -> usize {
        self.balance_calls.load(Ordering::SeqCst)
    }
}

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A tonic server on loopback: its address and the task serving it (stopped when dropped).
pub struct Served {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `bank` behind `layer` with tonic's server on `listener`.
pub fn serve<S: ChargesDb>(
    layer: safe_retry_server::grpc::GrpcIdempotencyLayer<S>,
    bank: Bank<S>,
    listener: tokio::net::TcpListener,
) -> Served {
    let addr = listener
        .local_addr()
        .expect("a bound listener has an address");
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let task = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .layer(layer)
            .serve_with_incoming(bank, incoming)
            .await;
        if let Err(error) = served {
            eprintln!("the bank stopped serving: {error}");
        }
    });
    Served { addr, task }
}

impl<S, B> tower_service::Service<http::Request<B>> for Bank<S>
where
    S: ChargesDb,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Boxed<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let bank = self.clone();
        Box::pin(async move {
            let answer = match request.uri().path() {
                CHARGE => {
                    let codec = tonic_prost::ProstCodec::<Receipt, Charge>::default();
                    let mut grpc = tonic::server::Grpc::new(codec);
                    grpc.unary(ChargeMethod(bank), request).await
                }
                STATEMENT => {
                    let codec = tonic_prost::ProstCodec::<Receipt, Charge>::default();
                    let mut grpc = tonic::server::Grpc::new(codec);
                    grpc.server_streaming(StatementMethod::<S>(std::marker::PhantomData), request)
                        .await
                }
                BATCH => {
                    let codec = tonic_prost::ProstCodec::<Receipt, Charge>::default();
                    let mut grpc = tonic::server::Grpc::new(codec);
                    grpc.client_streaming(BatchMethod::<S>(std::marker::PhantomData), request)
                        .await
                }
                BALANCE => {
                    bank.balance_calls.fetch_add(1, Ordering::SeqCst);
                    let codec = tonic_prost::ProstCodec::<Receipt, Charge>::default();
                    let mut grpc = tonic::server::Grpc::new(codec);
                    grpc.unary(BalanceMethod, request).await
                }
                _ => Status::unimplemented("no such method").into_http(),
            };
            Ok(answer)
        })
    }
}

struct ChargeMethod<S>(Bank<S>);

impl<S: ChargesDb> tonic::server::UnaryService<Charge> for ChargeMethod<S> {
    type Response = Receipt;
    type Future = Boxed<Result<tonic::Response<Receipt>, Status>>;

    fn call(&mut self, request: tonic::Request<Charge>) -> Self::Future {
        let orders = self.0.orders.clone();
        Box::pin(async move {
            let execution = Execution::<S>::of_grpc(&request)?;
            let charge = request.into_inner();
            if charge.cents < 0 {
                // An answer like any other: stored, unless the layer is told not to.
                return Err(Status::invalid_argument("a charge is never negative"));
            }
            if charge.cents == 0 {
                let refused = Status::invalid_argument("a charge is of at least one cent");
                return Err(Rejected::grpc(refused));
            }
            let receipt = charge_once(&orders, &execution, &charge).await?;
            let mut answer = tonic::Response::new(receipt.clone());
            answer
                .metadata_mut()
                .insert("x-order", receipt.order.to_string().parse().unwrap());
            Ok(answer)
        })
    }
}

/// The walk-through's order, over gRPC: each step a recovery point.
async fn charge_once<S: ChargesDb>(
    orders: &Orders,
    execution: &Execution<S>,
    charge: &Charge,
) -> Result<Receipt, StepError> {
    orders.faults.point("before-order").await?;
    let order: i64 = match execution.step("order").await? {
        Step::Done(order) => order,
        Step::Todo(mut step) => {
            let tx = step.tx().await?;
            let order = S::record_effect(tx, execution.key(), &charge.item)
                .await
                .map_err(StoreError::new)?;
            step.commit(order).await?
        }
    };
    orders.faults.point("after-order").await?;
    let id: String = match execution.step("charge").await? {
        Step::Done(id) => id,
        Step::Todo(mut step) => {
            let body = format!("{{\"order\":{order},\"amount\":{}}}", charge.cents);
            let url = format!("{}/charges", orders.payments);
            let answer = step.call(orders.client.post(url).body(body)).await?;
            orders.faults.point("after-charge-call").await?;
            let id = serde_json::from_slice::<serde_json::Value>(&answer.body)
                .ok()
                .and_then(|v| v["id"].as_str().map(str::to_owned))
                .unwrap_or_default();
            step.commit(id).await?
        }
    };
    orders.faults.point("after-charge").await?;
    if let Step::Todo(mut step) = execution.step::<()>("receipt").await? {
        let receipt = serde_json::json!({ "order": order, "charge": id });
        let url = format!("{}/receipts", orders.receipts);
        step.stage(&Message::post("receipt", url).json(&receipt))
            .await?;
        step.commit(()).await?;
    }
    orders.faults.point("after-receipt").await?;
    Ok(Receipt {
        order,
        charge: id,
        attempt: execution.attempt(),
    })
}

struct StatementMethod<S>(std::marker::PhantomData<fn() -> S>);

impl<S: ChargesDb> tonic::server::ServerStreamingService<Charge> for StatementMethod<S> {
    type Response = Receipt;
    type ResponseStream = tokio_stream::Iter<std::vec::IntoIter<Result<Receipt, Status>>>;
    type Future = Boxed<Result<tonic::Response<Self::ResponseStream>, Status>>;

    fn call(&mut self, request: tonic::Request<Charge>) -> Self::Future {
        Box::pin(async move {
            let execution = Execution::<S>::of_grpc(&request)?;
            let item = request.into_inner().item;
            let order = {
                let mut local = execution.local().await?;
                S::record_effect(&mut local, execution.key(), &item)
                    .await
                    .map_err(StoreError::new)?
            };
            let line = |n: i64| Receipt {
                order,
                charge: format!("line {n}"),
                attempt: execution.attempt(),
            };
            let mut end = Status::new(Code::OutOfRange, "the statement ends here");
            end.metadata_mut()
                .insert("x-balance", order.to_string().parse().unwrap());
            let messages = vec![Ok(line(1)), Ok(line(2)), Err(end)];
            Ok(tonic::Response::new(tokio_stream::iter(messages)))
        })
    }
}

struct BatchMethod<S>(std::marker::PhantomData<fn() -> S>);

impl<S: ChargesDb> tonic::server::ClientStreamingService<Charge> for BatchMethod<S> {
    type Response = Receipt;
    type Future = Boxed<Result<tonic::Response<Receipt>, Status>>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Charge>>) -> Self::Future {
        Box::pin(async move {
            let execution = Execution::<S>::of_grpc(&request)?;
            let mut charges = request.into_inner();
            let (mut items, mut cents) = (Vec::new(), 0);
            while let Some(charge) = charges.message().await? {
                items.push(charge.item);
                cents += charge.cents;
            }
            let mut local = execution.local().await?;
            let order = S::record_effect(&mut local, execution.key(), &items.join("+"))
                .await
                .map_err(StoreError::new)?;
            drop(local);
            Ok(tonic::Response::new(Receipt {
                order,
                charge: format!("{cents} cents"),
                attempt: execution.attempt(),
            }))
        })
    }
}

struct BalanceMethod;

impl tonic::server::UnaryService<Charge> for BalanceMethod {
    type Response = Receipt;
    type Future = Boxed<Result<tonic::Response<Receipt>, Status>>;

    fn call(&mut self, _: tonic::Request<Charge>) -> Self::Future {
        Box::pin(async { Ok(tonic::Response::new(Receipt::default())) })
    }
}
