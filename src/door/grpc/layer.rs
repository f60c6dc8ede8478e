//! The layer: the middleware of a gRPC config's dependencies (`GrpcConfig::routes`), and the
//! buffer its calls share.

use std::sync::Arc;

use tower_layer::Layer;

use super::call::Buffer;
use super::inner::{Channel, Shared};
use super::service::GrpcRetryService;
use crate::clock::Clock;
use crate::driver::middleware::RetryMiddleware;
use crate::engine::grpc::config::{GrpcConfig, dependency_name};
use crate::engine::grpc::rules::GrpcRules;
use crate::observe::CounterSnapshot;
use crate::observe::RetryEvent;
use crate::rng::RandomSource;

/// A tower [`Layer`] that retries gRPC calls as gRFC A6 says (feature `grpc`), around a tonic
/// `Channel` or any gRPC transport service: a generated client is
/// `FooClient::new(ServiceBuilder::new().layer(layer).service(channel))`.
///
/// Configured by a [`GrpcConfig`]: A6's retry policy per method or service, the channel's
/// [`RetryThrottling`](crate::grpc::RetryThrottling), which methods carry an idempotency key, and the
/// buffer limits. What each call does:
///
/// - its status is read from `grpc-status` in a trailers-only answer's headers; a status the
///   method's policy retries is retried, any other is final; once the server has sent headers
///   without a status the call is committed and never retried;
/// - the wait is A6's backoff, or exactly the server's `grpc-retry-pushback-ms` (a negative or
///   malformed one ends the call);
/// - every retry carries `grpc-previous-rpc-attempts`, and the call's `grpc-timeout` is its
///   deadline over every attempt, each told what is left of it;
/// - a transport failure is `UNAVAILABLE`; one that sent nothing (a refused connection) is
///   retried whatever the codes, within the policy's attempts;
/// - a method under a [`GrpcHedgingPolicy`](crate::grpc::GrpcHedgingPolicy) gets copies of each
///   call `hedgingDelay` apart (at once after a non-fatal failure, or after a pushback's wait);
///   the first answer, or a fatal code, ends the call and the other copies are cancelled;
/// - a call past its deadline ends `DEADLINE_EXCEEDED`;
/// - without [`RetryThrottling`](crate::grpc::RetryThrottling), retries are paid from a
///   [`RetryBudget`](crate::RetryBudget) shared by the layer's methods (A6 has none; this crate keeps its
///   guarantee that retries cannot multiply an outage).
///
/// The same clock, random source and observer as the middleware's, set the same way.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::grpc::{GrpcConfig, GrpcRetryLayer, GrpcRetryPolicy};
///
/// let policy = GrpcRetryPolicy::builder()
///     .max_attempts(3)
///     .initial_backoff(Duration::from_millis(100))
///     .max_backoff(Duration::from_secs(1))
///     .retryable_codes([tonic::Code::Unavailable])
///     .build()?;
/// let layer = GrpcRetryLayer::new(GrpcConfig::new().retry("echo.Echo", policy)?);
/// // let client = EchoClient::new(tower::ServiceBuilder::new().layer(layer).service(channel));
/// # drop(layer);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
#[derive(Debug, Clone)]
pub struct GrpcRetryLayer {
    retry: RetryMiddleware,
    channel: Arc<Channel>,
    /// The channels' target, as gRPC's metrics label it and its throttling counts per server;
    /// none given: `other` in the metrics, a count per channel.
    target: Option<Arc<str>>,
}

impl GrpcRetryLayer {
    /// The layer for `config`.
    pub fn new(config: GrpcConfig) -> Self {
        let buffer = Buffer::new(config.per_call_buffer, config.per_channel_buffer);
        GrpcRetryLayer {
            retry: RetryMiddleware::routed(config.routes()),
            target: None,
            channel: Arc::new(Channel {
                calls: config.calls(),
                config,
                buffer,
            }),
        }
    }

    /// What the calls `name` names have done so far, as
    /// [`Dependency::counters`](crate::Dependency::counters) counts them: `name` as given to [`GrpcConfig::retry`] or
    /// [`GrpcConfig::non_idempotent`] (`""` for every method, and for the calls no name
    /// covers). `None` for a name the config does not give. Clones of the layer, and every
    /// service it made, share the counts.
    pub fn counters(&self, name: &str) -> Option<CounterSnapshot> {
        let dependency = self.retry.dependency_named(&dependency_name(name))?;
        Some(dependency.counters())
    }

    /// Uses `clock` for every wait and every reading of the time, as
    /// [`RetryMiddleware::with_clock`] does.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.retry = self.retry.with_clock(clock);
        self
    }

    /// Draws jitter from `rng`, as [`RetryMiddleware::with_rng`] does.
    pub fn with_rng(mut self, rng: impl RandomSource) -> Self {
        self.retry = self.retry.with_rng(rng);
        self
    }

    /// Names the server the layer's channels go to, `target`, the channel's target as gRPC
    /// writes it (`dns:///ledger.example:443`): the services the layer makes around channels
    /// to one target share one [`RetryThrottling`](crate::grpc::RetryThrottling) count, as
    /// gRPC's C core keeps one per server name (without a target each service keeps its own),
    /// and gRPC's metrics (feature `metrics`; gRFC A96's `grpc.client.call.*`) label the calls
    /// with it as their `grpc.target` (without one, `other`).
    pub fn with_target(mut self, target: &str) -> Self {
        self.target = Some(Arc::from(target));
        self
    }

    /// Calls `observer` after every attempt with the decision about the next one, as
    /// [`RetryMiddleware::with_observer`] does.
    pub fn with_observer<F>(mut self, observer: F) -> Self
    where
        F: Fn(&RetryEvent<'_>) + Send + Sync + 'static,
    {
        self.retry = self.retry.with_observer(observer);
        self
    }
}

impl<S> Layer<S> for GrpcRetryLayer {
    type Service = GrpcRetryService<S>;

    /// The service around one channel: with the config's throttling, its server's count (A6
    /// counts per server; see [`with_target`](GrpcRetryLayer::with_target)), shared by its
    /// clones and every method called through it.
    fn layer(&self, inner: S) -> GrpcRetryService<S> {
        let server = self.target.as_deref();
        let throttling = (self.channel.config.throttling.as_ref()).map(|t| t.for_server(server));
        let retry = match &throttling {
            Some(throttling) => self.retry.with_each_dependency(|dependency| {
                let rules = dependency.rules.as_any().downcast_ref::<GrpcRules>();
                if let Some(rules) = rules {
                    let counted = rules.with_throttling(Some(throttling.clone()));
                    dependency.rules = Arc::new(counted);
                }
            }),
            None => self.retry.clone(),
        };
        GrpcRetryService {
            retry: Arc::new(retry),
            shared: Arc::new(Shared {
                service: inner,
                channel: self.channel.clone(),
                throttling,
                target: self.target.clone().unwrap_or_else(|| Arc::from("other")),
                #[cfg(feature = "metrics")]
                reporters: std::sync::Mutex::default(),
            }),
        }
    }
}
