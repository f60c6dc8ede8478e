//! Both halves over gRPC: this workspace's gRPC door, which sends one idempotency key on every
//! attempt of a method it is told is not idempotent, calling the bank behind the gRPC front
//! through a link that resets connections and drops answers by a seeded draw.

use std::sync::Arc;
use std::time::Duration;

use reqwest_safe_retry::RetryBudget;
use reqwest_safe_retry::grpc::{GrpcConfig, GrpcRetryLayer, GrpcRetryPolicy};
use safe_retry_server::IdempotencyLayer;
use safe_retry_server::grpc::GrpcIdempotencyLayer;
use tonic::{Code, Status};
use tower_layer::Layer;

use crate::bank::{Bank, CHARGE, Charge, Receipt, Served, serve};
use crate::charges_app::ChargesDb;
use crate::lossy_link::LossyLink;
use crate::orders_app::{Faults, Orders};
use crate::receiver::Receiver;

/// The bank behind the gRPC front, its dependencies, and the link in front of it.
pub struct Halves<S> {
    /// The bank's store.
    pub store: S,
    /// The bank's layer.
    pub layer: GrpcIdempotencyLayer<S>,
    /// The payment provider.
    pub payments: Arc<Receiver>,
    /// The link the client calls through.
    pub link: LossyLink,
    /// Where the bank listens, behind the link.
    pub server: Served,
    config: GrpcConfig,
}

impl<S: ChargesDb> Halves<S> {
    /// Starts the bank on `store` and a link to it drawing with `seed`.
    pub async fn start(store: S, seed: u64) -> Result<Halves<S>, Box<dyn std::error::Error>> {
        store.prepare().await?;
        let layer = IdempotencyLayer::builder(store.clone())
            .shared_scope()
            .grpc_method(CHARGE)
            // A copy that arrives while the first still runs comes back soon.
            .in_progress_retry_after(Duration::from_millis(20))
            .build_grpc()?;
        let (payments_addr, payments) = Receiver::start("ch").await;
        let (receipts_addr, _receipts) = Receiver::start("rc").await;
        let bank = Bank::new(Orders {
            client: crate::orders_app::dependencies(Duration::from_secs(5)),
            payments: format!("http://{payments_addr}"),
            receipts: format!("http://{receipts_addr}"),
            faults: Arc::new(Faults::default()),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let server = serve(layer.clone(), bank, listener);
        let link = LossyLink::start(server.addr, seed).await;
        // `bank.Bank/Charge` is retried on UNAVAILABLE (what a reset connection, and the
        // layer's in-progress answer, are) up to 20 attempts, each with the call's one key.
        let policy = GrpcRetryPolicy::builder()
            .allow_attempts_above_five(20)
            .max_attempts(20)
            .initial_backoff(Duration::from_millis(5))
            .max_backoff(Duration::from_millis(40))
            .backoff_multiplier(2.0)
            .retryable_codes([Code::Unavailable])
            .build()?;
        // The link fails one connection in two, far past what a budget for a healthy service
        // allows: this one holds enough for the run, so the run is about keys.
        let budget = RetryBudget::builder()
            .capacity(100_000.0)
            .initial(100_000.0)
            .build()?;
        let config = GrpcConfig::new()
            .retry("bank.Bank/Charge", policy)?
            .non_idempotent("bank.Bank/Charge")?
            .retry_budget(budget);
        Ok(Halves {
            store,
            layer,
            payments,
            link,
            server,
            config,
        })
    }

    /// One charge, as a caller makes it: tonic's client on a channel of its own (so that the
    /// link draws a fate for its connection) under the gRPC door.
    pub async fn charge(&self, item: &str) -> Result<Receipt, Status> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", self.link.addr))
            .map_err(|e| Status::internal(e.to_string()))?
            .connect_lazy();
        let door = GrpcRetryLayer::new(self.config.clone());
        let mut client = tonic::client::Grpc::new(door.layer(channel));
        client
            .ready()
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let request = tonic::Request::new(Charge {
            item: item.to_owned(),
            cents: 1000,
        });
        let codec = tonic_prost::ProstCodec::<Charge, Receipt>::default();
        let path = http::uri::PathAndQuery::from_static(CHARGE);
        Ok(client.unary(request, path, codec).await?.into_inner())
    }

    /// `calls` charges, `at_once` at a time: each caller's answer, in order.
    pub async fn charge_many(
        self: &Arc<Self>,
        calls: usize,
        at_once: usize,
    ) -> Vec<Result<Receipt, Status>>
    where
        S: ChargesDb,
    {
        let gate = Arc::new(tokio::sync::Semaphore::new(at_once.max(1)));
        let sends: Vec<_> = (0..calls)
            .map(|i| {
                let (halves, gate) = (self.clone(), gate.clone());
                tokio::spawn(async move {
                    let _turn = gate.acquire().await.expect("the gate stays open");
                    halves.charge(&format!("item {i}")).await
                })
            })
            .collect();
        let mut answers = Vec::with_capacity(calls);
        for send in sends {
            answers.push(
                send.await
                    .unwrap_or_else(|e| Err(Status::internal(e.to_string()))),
            );
        }
        answers
    }
}
