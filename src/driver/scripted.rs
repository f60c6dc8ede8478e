//! A door for the driver's own tests: copies that answer when the test says, on no socket.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};

use crate::driver::claim::Beneath;
use crate::engine::seen::{Failure, Locate, ResponseHead};

/// A door beneath whose copies answer when the test says: each copy sent takes the next
/// slot, and its future is pending until the test fills that slot. Counts the copies
/// dropped before they answered.
#[derive(Clone, Default)]
pub(crate) struct Scripted {
    pub(crate) slots: Arc<std::sync::Mutex<Vec<Option<reqwest_middleware::Result<Response>>>>>,
    pub(crate) dropped: Arc<std::sync::atomic::AtomicUsize>,
    /// Each copy, sent, answers at once with an empty 200 after this much virtual time.
    pub(crate) answer_after: Option<(crate::fake_clock::FakeClock, Duration)>,
    /// The headers each copy carried, in the order they were sent.
    pub(crate) headers: Arc<std::sync::Mutex<Vec<http::HeaderMap>>>,
    /// The attempt each copy was, as its extensions told the door (a hedge its attempt's).
    pub(crate) attempts: Arc<std::sync::Mutex<Vec<u32>>>,
}

impl Scripted {
    pub(crate) fn sent(&self) -> usize {
        self.slots.lock().unwrap().len()
    }

    pub(crate) fn answer(&self, copy: usize, outcome: reqwest_middleware::Result<Response>) {
        self.slots.lock().unwrap()[copy] = Some(outcome);
    }

    pub(crate) fn dropped(&self) -> usize {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A copy's future: the slot's outcome once it is filled.
pub(crate) struct Copy {
    at: usize,
    door: Scripted,
    done: bool,
}

impl Future for Copy {
    type Output = reqwest_middleware::Result<Response>;

    fn poll(mut self: Pin<&mut Self>, _: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let taken = self.door.slots.lock().unwrap()[self.at].take();
        match taken {
            Some(outcome) => {
                self.done = true;
                Poll::Ready(outcome)
            }
            None => Poll::Pending,
        }
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        if !self.done {
            (self.door.dropped).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

impl Beneath for Scripted {
    type Request = Request;
    type Reply = Response;
    type Error = reqwest_middleware::Error;
    type Running<'s> = Copy;

    type Ready = ();

    fn poll_ready(&self, ready: &mut Option<()>, _: &mut std::task::Context<'_>) -> Poll<bool> {
        *ready = Some(());
        Poll::Ready(true)
    }

    fn run_ready<'s>(&'s self, (): (), request: Request, e: &'s mut Extensions) -> Copy {
        self.run(request, e)
    }

    fn run<'s>(&'s self, request: Request, extensions: &'s mut Extensions) -> Copy {
        self.headers.lock().unwrap().push(request.headers().clone());
        let attempt = extensions.get::<crate::observe::RetryAttempt>();
        (self.attempts.lock().unwrap()).push(attempt.map_or(1, |a| a.number));
        let mut slots = self.slots.lock().unwrap();
        let at = slots.len();
        slots.push(None);
        if let Some((clock, takes)) = &self.answer_after {
            clock.advance(*takes);
            slots[at] = Some(Ok(Response::from(http::Response::new(""))));
        }
        drop(slots);
        Copy {
            at,
            door: self.clone(),
            done: false,
        }
    }

    fn head<'o>(&'o self, reply: &'o Response, _: &'o dyn Locate) -> ResponseHead<'o> {
        ResponseHead {
            status: reply.status(),
            version: reply.version(),
            headers: reply.headers(),
            from: reply.url(),
        }
    }

    /// These copies end only in the attempt's timeout, the layer's own: an error of the door
    /// is a test's mistake.
    fn failure<'o>(&'o self, err: &'o reqwest_middleware::Error) -> Failure<'o> {
        unreachable!("a scripted copy fails only by its timeout: {err}")
    }
}
