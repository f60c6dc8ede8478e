//! Time, injected.
//!
//! Every wait the middleware makes, every per-attempt timeout and every reading of "now" that
//! decides whether to wait goes through a [`Clock`]. In production that is [`TokioClock`]. In
//! tests it is `FakeClock` (feature `test-util`): its sleeps finish at once, advance virtual
//! time and are recorded, so a schedule with minutes of backoff runs in microseconds and can be
//! asserted to the nanosecond; its timeouts fire only when virtual time reaches them.
//!
//! How sleeps differ from timeouts is on [`Clock`]; how the tokio clock meets a paused runtime
//! and keeps spare timers, on [`TokioClock`]: where they render. In the browser
//! (`wasm32`) the production clock is `BrowserClock`, on the page's own timers.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

#[cfg(target_arch = "wasm32")]
mod browser;
#[cfg(not(target_arch = "wasm32"))]
mod tokio_time;

#[cfg(target_arch = "wasm32")]
pub use browser::BrowserClock;
#[cfg(not(target_arch = "wasm32"))]
pub use tokio_time::TokioClock;
#[cfg(not(target_arch = "wasm32"))]
use tokio_time::TokioTimeout;

/// The monotonic instant a [`Clock`] reads: `std::time::Instant`, and in the browser
/// (`wasm32`), where the standard library's panics when read, web-time's, on
/// `performance.now()`.
#[cfg(not(target_arch = "wasm32"))]
pub use std::time::Instant;
/// The monotonic instant a [`Clock`] reads: `std::time::Instant`, and in the browser
/// (`wasm32`), where the standard library's panics when read, web-time's, on
/// `performance.now()`.
#[cfg(target_arch = "wasm32")]
pub use web_time::Instant;

/// The future a [`Clock`] returns from [`Clock::sleep`] and [`Clock::timeout`]: `Send`, but in
/// the browser (`wasm32`), whose timers belong to the page's one thread.
#[cfg(not(target_arch = "wasm32"))]
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;
/// The future a [`Clock`] returns from [`Clock::sleep`] and [`Clock::timeout`]: `Send`, but in
/// the browser (`wasm32`), whose timers belong to the page's one thread.
#[cfg(target_arch = "wasm32")]
pub type Sleep = Pin<Box<dyn Future<Output = ()> + 'static>>;

/// A source of time: a monotonic "now" for deadlines, a wall "now" for HTTP dates, sleeping, and
/// timeouts.
///
/// Implement it to drive the middleware from your own timer:
///
/// ```
/// use std::time::{Duration, Instant, SystemTime};
/// use reqwest_safe_retry::{Clock, Sleep};
///
/// /// A clock whose sleeps return at once and whose attempts never time out.
/// #[derive(Debug)]
/// struct Impatient;
///
/// impl Clock for Impatient {
///     fn now(&self) -> Instant { Instant::now() }
///     fn wall_now(&self) -> SystemTime { SystemTime::now() }
///     fn sleep(&self, _: Duration) -> Sleep { Box::pin(async {}) }
///     fn timeout(&self, _: Duration) -> Sleep { Box::pin(std::future::pending()) }
/// }
///
/// // The middleware keeps clocks as trait objects.
/// let _clock: Box<dyn Clock> = Box::new(Impatient);
/// ```
///
/// [`Instant`](crate::Instant) is `std::time::Instant`, and web-time's in the browser
/// (`wasm32`): a clock built for both names it `reqwest_safe_retry::Instant`.
///
/// # Sleeps and timeouts are different things
///
/// [`Clock::sleep`] is a wait the middleware chose: a virtual clock may simply jump over it.
/// [`Clock::timeout`] is a limit raced against real work (an attempt on the wire): a virtual
/// clock must not jump to it on its own, or every attempt would time out before the server
/// could answer. `FakeClock` fires it when its time is moved past it (by a sleep or an
/// `advance`).
///
pub trait Clock: Send + Sync + 'static {
    /// The current monotonic instant; deadlines are measured on it.
    fn now(&self) -> Instant;
    /// The current wall-clock time; `Retry-After` dates are read against it.
    fn wall_now(&self) -> SystemTime;
    /// A wait of `duration` on this clock: the backoff between attempts. A virtual clock may
    /// complete it at once and move its time forward.
    fn sleep(&self, duration: Duration) -> Sleep;
    /// A future that completes once `duration` has passed on this clock while other work runs:
    /// the per-attempt timeout, raced against the attempt. Unlike [`sleep`](Clock::sleep), a
    /// virtual clock must not move its time forward for it, only fire it when its time has moved
    /// past it.
    fn timeout(&self, duration: Duration) -> Sleep;
}

/// The clock as the middleware stores it: shared, with a `Debug` that does not require one from
/// the user's type, and knowing whether it is tokio's (whose timer may be missing).
#[derive(Clone)]
pub(crate) struct SharedClock {
    clock: Arc<dyn Clock>,
    #[cfg(not(target_arch = "wasm32"))]
    tokio: bool,
}

impl SharedClock {
    pub(crate) fn new<C: Clock>(clock: C) -> SharedClock {
        SharedClock {
            #[cfg(not(target_arch = "wasm32"))]
            tokio: std::any::TypeId::of::<C>() == std::any::TypeId::of::<TokioClock>(),
            clock: Arc::new(clock),
        }
    }

    /// The production clock: tokio's, and in the browser the page's.
    pub(crate) fn production() -> SharedClock {
        #[cfg(not(target_arch = "wasm32"))]
        return SharedClock::new(TokioClock::new());
        #[cfg(target_arch = "wasm32")]
        return SharedClock::new(BrowserClock::new());
    }

    /// The clock, to read the time from and to sleep on.
    pub(crate) fn get(&self) -> &dyn Clock {
        &*self.clock
    }

    /// The per-attempt timeout. On a [`TokioClock`] in a runtime without a time driver, tokio
    /// panics when a timer is made; that panic is caught here and becomes an error, so the
    /// first attempt's timer is also the check, at no cost to a runtime that has the driver.
    ///
    /// `read` is a reading of this clock taken earlier in the same poll, if there is one: a
    /// tokio clock then needs one reading fewer to tell whether it is paused.
    pub(crate) fn timeout(
        &self,
        duration: Duration,
        read: Option<Instant>,
    ) -> Result<AttemptTimer, TimerUnavailable> {
        #[cfg(not(target_arch = "wasm32"))]
        if self.tokio {
            return std::panic::catch_unwind(|| TokioTimeout::new(duration, read))
                .map(|timeout| AttemptTimer::Tokio { timeout })
                .map_err(|_| TimerUnavailable);
        }
        let _ = read;
        Ok(AttemptTimer::Boxed {
            sleep: self.clock.timeout(duration),
        })
    }
}

impl SharedClock {
    /// A wait on the clock that may come before any timer of the request has been made (the
    /// hold of a spent quota): on a [`TokioClock`] without tokio's time driver, tokio panics
    /// when the sleep is made, and that becomes an error here, as for [`timeout`](Self::timeout).
    pub(crate) fn checked_sleep(&self, duration: Duration) -> Result<Sleep, TimerUnavailable> {
        #[cfg(not(target_arch = "wasm32"))]
        if self.tokio {
            // The clock is a `TokioClock`, which holds nothing: one made here sleeps the same.
            return std::panic::catch_unwind(|| TokioClock::new().sleep(duration))
                .map_err(|_| TimerUnavailable);
        }
        Ok(self.clock.sleep(duration))
    }
}

impl SharedClock {
    /// A wait on the clock: a hold before an attempt (which may come before any timer of the
    /// request was made), or the wait before a retry.
    pub(crate) async fn wait(&self, duration: Duration) -> Result<(), TimerUnavailable> {
        self.checked_sleep(duration)?.await;
        Ok(())
    }
}

#[cfg(not(target_arch = "wasm32"))]
pin_project_lite::pin_project! {
    /// A per-attempt timeout as the middleware holds it: tokio's inline, any other clock's
    /// boxed. Ready when the timeout has passed.
    #[project = AttemptTimerProj]
    pub(crate) enum AttemptTimer {
        Tokio {
            #[pin]
            timeout: TokioTimeout,
        },
        Boxed { sleep: Sleep },
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl Future for AttemptTimer {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.project() {
            AttemptTimerProj::Tokio { timeout } => timeout.poll(cx),
            AttemptTimerProj::Boxed { sleep } => sleep.as_mut().poll(cx),
        }
    }
}

/// A per-attempt timeout as the middleware holds it: in the browser, the clock's own, boxed.
#[cfg(target_arch = "wasm32")]
pub(crate) enum AttemptTimer {
    Boxed { sleep: Sleep },
}

#[cfg(target_arch = "wasm32")]
impl Future for AttemptTimer {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // A boxed future is `Unpin`.
        let AttemptTimer::Boxed { sleep } = self.get_mut();
        sleep.as_mut().poll(cx)
    }
}

impl fmt::Debug for SharedClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Clock")
    }
}

/// The request was made on a runtime without tokio's timer while the middleware's clock is
/// [`TokioClock`]; nothing was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "TokioClock needs tokio's timer, and there is none here: run the request on a tokio \
     runtime built with enable_time() or enable_all(), or give the middleware another Clock \
     (with_clock)"
)]
pub(crate) struct TimerUnavailable;
