//! The tower door's errors: the inner service's, read by their causes, and the error the
//! layer hands back.

use crate::error::RetryError;
use crate::fault::{self, Fault};

/// An error of the inner service or of the layer, as tower passes errors: boxed.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An error as the layer hands it back: the [`RetryError`] when the layer made the attempts,
/// the inner service's own error when it passed the request through, reqwest's when the
/// request could not be made.
pub(super) fn boxed(err: reqwest_middleware::Error) -> BoxError {
    match err {
        reqwest_middleware::Error::Reqwest(e) => Box::new(e),
        reqwest_middleware::Error::Middleware(e) => match e.downcast::<RetryError>() {
            Ok(retry) => Box::new(retry),
            Err(e) => match e.downcast::<ServiceError>() {
                Ok(ServiceError(inner)) => inner,
                Err(e) => e.into(),
            },
        },
    }
}

/// An error of the inner service: judged by its causes (a refused or reset connection, a
/// timeout, a response cut short, an HTTP/2 refusal), as a transport error is.
#[derive(Debug)]
pub(crate) struct ServiceError(pub(crate) BoxError);

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ServiceError {
    /// The inner service's own error, so a caller walking the sources of a
    /// [`RetryError`] finds it and can downcast to it.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// The transient fault behind a tower service's error: the same causes as behind reqwest's,
/// and a connect failure of hyper-util's client told apart as reqwest's is (nothing was sent).
pub(super) fn service_fault(err: &ServiceError) -> Option<Fault> {
    let err: &(dyn std::error::Error + 'static) = &*err.0;
    let cause = fault::of_causes(err);
    let mut source = Some(err);
    // Bounded, as every walk of a chain here.
    for _ in 0..64 {
        let Some(at) = source else { break };
        if let Some(client) = at.downcast_ref::<hyper_util::client::legacy::Error>() {
            if client.is_connect() {
                let passing = cause.is_some() || fault::resolution_failed(err);
                return passing.then_some(Fault::Connect);
            }
        }
        source = at.source();
    }
    cause
}
