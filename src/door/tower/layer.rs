//! The middleware as a tower [`Layer`].

use std::sync::Arc;

use tower_layer::Layer;

use super::service::RetryService;
use crate::driver::middleware::RetryMiddleware;

impl<S> Layer<S> for RetryMiddleware {
    type Service = RetryService<S>;

    /// Wraps `inner`: every request through the returned service is retried as this middleware
    /// retries the requests of a `reqwest-middleware` chain.
    fn layer(&self, inner: S) -> RetryService<S> {
        RetryService {
            retry: Arc::new(self.clone()),
            inner: Arc::new(inner),
        }
    }
}
