//! The tower door's errors: the inner service's, boxed as tower passes errors, read by their
//! causes.

pub(crate) use crate::error::BoxError;
use crate::fault::{self, Fault};

/// The transient fault behind an error of the inner service (or of its answer's body): the
/// same causes as behind reqwest's (a refused or reset connection, a timeout, a response cut
/// short, an HTTP/2 refusal), and a connect failure of hyper-util's client told apart as
/// reqwest's is (nothing was sent).
pub(super) fn service_fault(err: &BoxError) -> Option<Fault> {
    let err: &(dyn std::error::Error + 'static) = &**err;
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
