//! What the two doors typed in `http` (tower's, gRPC's) share about the tower service beneath
//! them: a copy of a request whose body is whole in memory, and a clone of the service asked
//! until it is ready for a hedge.

use std::task::{Context, Poll};

use tower_service::Service;

use crate::driver::send_body::SendBody;

/// A copy of `request` for another attempt, without its extensions (the driver keeps them and
/// hands each copy its own), its bytes shared by reference count; `None` when its body can be
/// sent only once.
pub(crate) fn copy_of<B>(
    request: &http::Request<SendBody<B>>,
) -> Option<http::Request<SendBody<B>>> {
    let bytes = request.body().as_bytes()?;
    let mut copy = http::Request::new(SendBody::whole(bytes.clone()));
    *copy.method_mut() = request.method().clone();
    *copy.version_mut() = request.version();
    *copy.uri_mut() = request.uri().clone();
    // The headers `Request::new` gave: a map that never allocated, forgotten rather than
    // dropped (its drop walks its empty parts, about 50 instructions a copy).
    let empty = std::mem::replace(copy.headers_mut(), request.headers().clone());
    if empty.capacity() == 0 {
        std::mem::forget(empty);
    }
    Some(copy)
}

/// Whether a clone of `service`, kept in `ready` between polls, is ready to take a copy, asked
/// with the request's own waker: `Ready(false)` when it failed to become ready (the clone is
/// dropped, and no hedge goes).
pub(crate) fn poll_clone_ready<S, Q>(
    service: &S,
    ready: &mut Option<S>,
    cx: &mut Context<'_>,
) -> Poll<bool>
where
    S: Service<Q> + Clone,
{
    let clone = ready.get_or_insert_with(|| service.clone());
    match clone.poll_ready(cx) {
        Poll::Ready(Ok(())) => Poll::Ready(true),
        Poll::Ready(Err(_)) => {
            *ready = None;
            Poll::Ready(false)
        }
        Poll::Pending => Poll::Pending,
    }
}
