//! The reqwest door's answers and errors in the browser (`wasm32`), where reqwest speaks
//! through `fetch`: its answer has no extensions and cannot be rebuilt around a body, and its
//! errors say less of the connection than a socket does.

use std::future::Future;

use bytes::Bytes;
use reqwest::Response;

use crate::driver::body::{Prefix, Reply};
use crate::fault::Fault;
use crate::maybe_send::MaybeSend;
use crate::record::RetryRecord;

impl Reply for Response {
    type Error = reqwest_middleware::Error;

    /// No body is read inside an attempt here: `buffer_body` is refused when the policy is
    /// built, and a transient answer is kept through the wait with its body unread.
    const READS_BODY: bool = false;

    fn status(&self) -> http::StatusCode {
        Response::status(self)
    }

    fn headers(&self) -> &http::HeaderMap {
        Response::headers(self)
    }

    fn headers_mut(&mut self) -> &mut http::HeaderMap {
        Response::headers_mut(self)
    }

    /// A page's answer has no extensions to carry the record in; the observer sees every
    /// attempt instead, and an error carries its record as everywhere.
    fn carry(&mut self, record: RetryRecord) {
        drop(record);
    }

    fn content_length(&self) -> Option<u64> {
        Response::content_length(self)
    }

    /// Never asked for (`READS_BODY` is false): the end of a body it does not read.
    fn chunk(
        &mut self,
    ) -> impl Future<Output = Result<Option<Bytes>, reqwest_middleware::Error>> + MaybeSend {
        std::future::ready(Ok(None))
    }

    /// Never asked for (`READS_BODY` is false): the answer as it is.
    fn read_whole(self, _: Bytes) -> Self {
        self
    }

    /// Never asked for (`READS_BODY` is false): the answer as it is.
    fn read_first(self, _: Prefix) -> Self {
        self
    }
}

/// What a `fetch` that failed stands for. A page is told only that the request failed (a
/// `TypeError`), never why: a refused connection, a reset, a name that did not resolve, a CORS
/// refusal and a blocked port all read alike, and none says whether the server got the
/// request. So such a failure is read as a connection lost after it was made
/// ([`Fault::Reset`]): retried when repeating is safe (an idempotent method, or a request with
/// an idempotency key), never as "nothing was sent". reqwest's own timeout (its `timeout`,
/// an aborted `fetch`) is a timeout.
pub(super) fn reqwest_fault(err: &reqwest::Error) -> Option<Fault> {
    if err.is_builder() || err.is_redirect() || err.is_status() || err.is_decode() {
        return None;
    }
    if err.is_timeout() {
        return Some(Fault::Timeout);
    }
    (err.is_request() || err.is_body()).then_some(Fault::Reset)
}
