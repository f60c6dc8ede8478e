//! Layers: retrying layers stacked over a dead backend.
//!
//! A request path often crosses several retrying layers (an SDK, a service client, a sidecar).
//! Each retrying on its own multiplies: three attempts at each of four layers is 81 attempts at
//! the backend per request. Stacked instances of this crate's middleware follow the one-layer
//! rule instead: the instance nearest the backend retries, and the others pass its outcome
//! through. "Without the rule" stacks plain retrying layers that know nothing of each other.

use std::sync::Arc;
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};

use super::{Backend, VirtualTime, block_on_paused};
use reqwest_safe_retry::RetryPolicy;
use reqwest_safe_retry::{Dependency, RetryMiddleware};

/// The layers scenario's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layers {
    /// Retrying layers on the path, from 1.
    pub depth: u32,
    /// Attempts each layer allows, the first included.
    pub attempts_per_layer: u32,
    /// Whether the layers are this crate's middleware (one layer retries) or plain retrying
    /// layers (each retries on its own).
    pub single_layer_rule: bool,
    /// Top-level requests sent.
    pub requests: u32,
}

/// What a layers run observed.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct LayersReport {
    /// Attempts that reached the backend, per top-level request.
    pub backend_attempts_per_request: f64,
}

/// A retrying layer without the one-layer rule: up to `attempts` tries on any 5xx or error.
#[derive(Debug)]
struct PlainRetry {
    attempts: u32,
}

#[async_trait::async_trait]
impl Middleware for PlainRetry {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let mut attempt = 1;
        loop {
            let copy = request.try_clone();
            let Some(sending) = copy else {
                return next.run(request, extensions).await;
            };
            let outcome = next.clone().run(sending, extensions).await;
            let failed = match &outcome {
                Ok(response) => response.status().is_server_error(),
                Err(_) => true,
            };
            if !failed || attempt >= self.attempts {
                return outcome;
            }
            attempt += 1;
        }
    }
}

impl Layers {
    /// Runs every request to its end.
    ///
    /// # Panics
    ///
    /// If a tokio runtime cannot be built.
    pub fn run(&self) -> LayersReport {
        let policy = RetryPolicy::builder()
            .max_attempts(self.attempts_per_layer.max(1))
            .base_delay(Duration::ZERO)
            .max_delay(Duration::ZERO)
            .build()
            .expect("at least one attempt and equal delays make a valid policy");
        let requests = self.requests.max(1);
        let attempts = block_on_paused(async {
            let backend = Arc::new(Backend::new(|_| (503, None)));
            let mut builder = ClientBuilder::new(reqwest::Client::new());
            for _ in 0..self.depth {
                builder = if self.single_layer_rule {
                    builder.with(
                        RetryMiddleware::new(Dependency::new("layer", policy).without_budget())
                            .with_clock(VirtualTime),
                    )
                } else {
                    builder.with(PlainRetry {
                        attempts: self.attempts_per_layer,
                    })
                };
            }
            let client = builder.with_arc(backend.clone()).build();
            for _ in 0..requests {
                let _ = client.get("http://127.0.0.1:9/").send().await;
            }
            backend.arrivals().len()
        });
        LayersReport {
            backend_attempts_per_request: attempts as f64 / f64::from(requests),
        }
    }
}
