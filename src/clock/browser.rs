//! [`BrowserClock`], the production clock in the browser (`wasm32`): the page's own timers.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use gloo_timers::future::TimeoutFuture;

use super::{Clock, Instant, Sleep};

/// The production clock in the browser (`wasm32`, reqwest over `fetch`): `performance.now()`
/// for deadlines, `Date.now()` for HTTP dates, and `setTimeout` for waits and per-attempt
/// timeouts. It is what [`RetryMiddleware::new`](crate::RetryMiddleware::new) takes there;
/// tokio's timer does not run in a page.
///
/// A wait never ends before its time, and may end later: browsers round timers to a
/// millisecond or more and slow those of a tab in the background (to once a second, or less
/// often), so a 100 ms backoff in a hidden tab can take a second. A wait longer than
/// `setTimeout` can hold (2³¹ − 1 ms, about 24.8 days; a longer one fires at once) is made in
/// steps of at most that.
///
/// Its sleeps and timeouts are not `Send`: a page's timers belong to its one thread.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct BrowserClock;

impl BrowserClock {
    /// Creates the browser's clock; `const`, so a `static` can hold one (`Default` gives the
    /// same).
    pub const fn new() -> Self {
        BrowserClock
    }
}

impl Clock for BrowserClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn wall_now(&self) -> SystemTime {
        // std's `SystemTime` cannot read the time in a page, but it can hold one: the epoch
        // and the page's milliseconds since it.
        let since_epoch = web_time::SystemTime::now()
            .duration_since(web_time::UNIX_EPOCH)
            .unwrap_or_default();
        SystemTime::UNIX_EPOCH
            .checked_add(since_epoch)
            .unwrap_or(SystemTime::UNIX_EPOCH)
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        Box::pin(Timer::new(duration))
    }

    fn timeout(&self, duration: Duration) -> Sleep {
        Box::pin(Timer::new(duration))
    }
}

/// The longest wait one `setTimeout` makes as asked: 2³¹ − 1 ms.
const LONGEST_STEP: Duration = Duration::from_millis(i32::MAX as u64);

/// A wait on `setTimeout`, in steps no longer than [`LONGEST_STEP`], each rounded up to the
/// millisecond.
struct Timer {
    /// What is left to wait after the step under way.
    left: Duration,
    step: Option<TimeoutFuture>,
}

impl Timer {
    fn new(duration: Duration) -> Timer {
        Timer {
            left: duration,
            step: None,
        }
    }
}

/// `step` in whole milliseconds, rounded up (at most [`LONGEST_STEP`]'s).
fn millis_up(step: Duration) -> u32 {
    let millis = step.as_nanos().div_ceil(1_000_000);
    u32::try_from(millis).map_or(i32::MAX as u32, |m| m.min(i32::MAX as u32))
}

impl Future for Timer {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // Bounded: each turn ends a step or returns; a wait has at most a few steps.
        loop {
            if let Some(step) = &mut self.step {
                std::task::ready!(Pin::new(step).poll(cx));
                self.step = None;
            }
            if self.left.is_zero() {
                return Poll::Ready(());
            }
            let step = self.left.min(LONGEST_STEP);
            self.left -= step;
            self.step = Some(TimeoutFuture::new(millis_up(step)));
        }
    }
}
