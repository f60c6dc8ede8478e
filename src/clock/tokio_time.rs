//! [`TokioClock`], the production clock outside the browser: tokio's timer, its paused clock,
//! and the spare timers that spare a successful attempt the timer wheel's lock.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use super::{Clock, Sleep};

/// The production clock: tokio's timer and the system's wall clock.
///
/// Its monotonic time is tokio's, so it follows a runtime whose clock is paused
/// (`tokio::time::pause`, `#[tokio::test(start_paused = true)]`): backoff waits, the deadline
/// and per-attempt timeouts take no real time there.
///
/// It needs tokio's time driver (`enable_time()` or `enable_all()` on the runtime builder); on a
/// runtime without one the middleware fails each request, before sending it, with an error that
/// says so. tokio reports a missing driver only by panicking, and the middleware catches that
/// panic; in a program built with `panic = "abort"` it cannot, and the process aborts as tokio
/// would have made it.
///
/// # Tokio's paused clock
///
/// Under `tokio::time::pause()` (or `#[tokio::test(start_paused = true)]`) tokio jumps its clock
/// to the next timer whenever the runtime is idle, even while a socket is waiting for a real
/// server on threads of its own (wiremock's): an attempt timed on tokio's timer alone would be
/// cut there at once (41 of 50 loopback requests to wiremock, measured). So each attempt holds
/// tokio's auto-advance for its first 100 ms of real time (a blocking task, ended with the
/// attempt): a server elsewhere answers within it, and virtual time stands still meanwhile.
/// After that the attempt's timeout is tokio's own, in virtual time: a server on the same
/// runtime that waits with `tokio::time::sleep` answers when tokio advances to the end of its
/// sleep, and one that sleeps past the attempt timeout is cut at it, as on a running clock.
///
/// A runtime learns from its holds: one that runs out with its attempt still waiting says the
/// server answers in virtual time, and the next holds are a quarter as long, down to 2 ms, so
/// that a hundred requests retried at once, at a hundred virtual instants, take a few hundred
/// milliseconds of real time rather than a hundred holds of 100 ms each (6.7 s before). An
/// attempt whose timer fires before its 100 ms of real time (its hold was short) still waits
/// the rest of them for a server elsewhere, and takes its answer; virtual time has then moved
/// to the attempt's timeout, and the runtime's holds are 100 ms again.
///
/// # Spare timers
///
/// Making a tokio timer, filing it in tokio's timer wheel and taking it out again costs more
/// than the rest of a successful attempt's bookkeeping. So [`TokioClock`] keeps the timer of an
/// attempt that ended on the thread that ended it (up to 64 per thread, for one runtime), still
/// filed, and gives it to the next attempt there: a spare set for an earlier deadline fires once
/// at it (the attempt's task is woken, finds its own deadline not reached, and moves the spare
/// to it); one set for a later deadline is moved at once. An idle spare stays in the wheel
/// until its last deadline, when it wakes the task that last waited on it once, for nothing.
/// Under a clock paused later on the same runtime, auto-advance may fire such spares on its
/// way to the timers that are waited for.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct TokioClock;

impl TokioClock {
    /// Creates the production clock; `const`, so a `static` can hold one (`Default` gives the
    /// same).
    pub const fn new() -> Self {
        TokioClock
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn wall_now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        if duration.is_zero() {
            // tokio's timer ticks in milliseconds: a zero sleep would still wait for the next
            // tick. Yielding lets other tasks run without that wait.
            return Box::pin(tokio::task::yield_now());
        }
        Box::pin(tokio::time::sleep(duration))
    }

    fn timeout(&self, duration: Duration) -> Sleep {
        Box::pin(TokioTimeout::new(duration, None))
    }
}

/// [`TokioClock`]'s per-attempt timeout, made eagerly (so a missing time driver shows at once)
/// and polled in place: the middleware keeps it inline in its own future, with no future nested
/// in another. Always tokio's own timer; under a paused clock, it also holds tokio's
/// auto-advance for a grace of real time (see [`Grace`]).
pub(crate) struct TokioTimeout {
    sleep: Armed,
    /// The deadline on tokio's clock (`None`: beyond the `Instant` range).
    deadline: Option<tokio::time::Instant>,
    /// Set while tokio's clock is paused: a server elsewhere is given real time to answer
    /// before auto-advance may move the clock (to this timer, or any other).
    hold: Option<Hold>,
}

/// How long, in real time, an attempt under tokio's paused clock holds its auto-advance at
/// most: a server on threads of its own (wiremock's) answers a loopback request in well under
/// a millisecond (4.6 ms at most of 2,400, with four busy loops on two cores), so the grace has
/// twenty times that; a server on the runtime itself that waits with `tokio::time::sleep` is
/// answered in virtual time once it ends.
pub(crate) const PAUSED_GRACE: Duration = Duration::from_millis(100);

/// The shortest hold a runtime's attempts learn to make (see [`Grace`]).
const LEAST_GRACE: Duration = Duration::from_millis(2);

/// What a runtime whose clock is paused has learned of its servers: how long an attempt holds
/// tokio's auto-advance. A hold that ran out with its attempt still waiting says the server is
/// not answering in real time (one on the runtime itself, asleep on tokio's clock, which the
/// hold keeps from moving): the next holds are a quarter as long, down to 2 ms, so that many
/// requests retried at once, at many virtual instants, do not each wait 100 ms of real time.
/// An attempt whose timer fired before its whole allowance of real time (the hold was short)
/// waits the rest of it; answered then (a server elsewhere, slower than the shortened hold),
/// it sets the grace back to [`PAUSED_GRACE`].
#[derive(Debug)]
struct Grace {
    runtime: tokio::runtime::Id,
    /// In microseconds.
    micros: std::sync::atomic::AtomicU64,
}

impl Grace {
    /// The current runtime's.
    fn of_runtime() -> Arc<Grace> {
        /// The runtimes that held lately (a runtime that ends leaves its entry, so few are kept).
        static RUNTIMES: Mutex<Vec<Arc<Grace>>> = Mutex::new(Vec::new());
        let runtime = tokio::runtime::Handle::current().id();
        let mut runtimes = RUNTIMES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(grace) = runtimes.iter().find(|g| g.runtime == runtime) {
            return grace.clone();
        }
        if runtimes.len() >= 64 {
            runtimes.remove(0);
        }
        let grace = Arc::new(Grace {
            runtime,
            micros: std::sync::atomic::AtomicU64::new(micros(PAUSED_GRACE)),
        });
        runtimes.push(grace.clone());
        grace
    }

    fn now(&self) -> Duration {
        let micros = self.micros.load(std::sync::atomic::Ordering::Relaxed);
        Duration::from_micros(micros)
    }

    /// A hold ran out with its attempt still waiting.
    fn ran_out(&self) {
        let _ = self.micros.fetch_update(
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
            |m| Some((m / 4).max(micros(LEAST_GRACE))),
        );
    }

    /// An attempt was answered from elsewhere in real time.
    fn answered(&self) {
        let full = micros(PAUSED_GRACE);
        self.micros
            .store(full, std::sync::atomic::Ordering::Relaxed);
    }
}

/// `d` in microseconds, saturating.
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl TokioTimeout {
    /// Arms a timeout of `duration`. Panics, as tokio does, outside a runtime or on one without
    /// a time driver.
    ///
    /// `read` is a reading of [`TokioClock`] taken earlier in the same poll, if there is one.
    pub(crate) fn new(duration: Duration, read: Option<Instant>) -> TokioTimeout {
        // A paused clock cannot move while this code runs: it moves only when the runtime
        // parks. A running one (tokio's `now` is then the real `now`) ticks between two
        // readings, at nanosecond resolution. A coarse clock that read the same twice would
        // only hold auto-advance that is not there, for a moment.
        let first = read.map_or_else(tokio::time::Instant::now, tokio::time::Instant::from_std);
        let second = tokio::time::Instant::now();
        let hold = (first == second).then(|| {
            let grace = Grace::of_runtime();
            let (allowance, held) = (duration.min(PAUSED_GRACE), duration.min(grace.now()));
            let short = (held < allowance).then(|| (Instant::now(), allowance));
            Hold::start(held, grace, Wake::Later(short))
        });
        // The deadline from the reading just made, rather than a third one.
        let deadline = second.checked_add(duration);
        TokioTimeout {
            sleep: Armed::until(deadline, duration),
            deadline,
            hold,
        }
    }
}

impl Future for TokioTimeout {
    type Output = ();

    /// Ready when the timeout has passed on tokio's clock; under a paused clock, and no sooner
    /// than [`PAUSED_GRACE`] of real time after the attempt began (a server elsewhere answers
    /// within it).
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(hold) = &self.hold {
            if hold.waking() {
                // The rest of the grace, waited after the timer fired early.
                if !hold.ran_out(cx) {
                    return Poll::Pending;
                }
                self.hold = None;
                return Poll::Ready(());
            }
        }
        let deadline = self.deadline;
        std::task::ready!(self.sleep.poll(cx, deadline));
        if let Some(hold) = self.hold.take() {
            if let Some((began, allowance)) = hold.short() {
                let spent = began.elapsed();
                if spent < allowance {
                    // The hold was short, learned from servers that answer in virtual time: a
                    // server elsewhere is still given the whole allowance before the attempt
                    // is cut.
                    let grace = hold.state.grace.clone();
                    drop(hold);
                    let rest = Wake::Task(cx.waker().clone());
                    self.hold = Some(Hold::start(allowance - spent, grace, rest));
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(())
    }
}

/// Tokio's auto-advance held, for when its clock is paused: a blocking task that waits on a
/// condition variable for a grace of real time. While a blocking task runs, tokio does not
/// auto-advance its paused clock, so no timer (this attempt's, a connection pool's, the
/// caller's) jumps virtual time forward while a server elsewhere answers. Dropping it (the
/// attempt ended) ends the task at once, and tells the runtime's [`Grace`] the attempt was
/// answered within it; running out tells it that it was not.
pub(crate) struct Hold {
    state: Arc<HoldState>,
}

/// What a hold and its blocking task share.
struct HoldState {
    /// (the attempt ended, the grace ran out), and the condition the task waits on.
    flags: Mutex<(bool, bool)>,
    wakeup: Condvar,
    grace: Arc<Grace>,
    /// The task to wake when the grace runs out: a timer waiting the rest of its grace.
    waker: Mutex<Option<std::task::Waker>>,
    /// A hold at its attempt's start shorter than the attempt's allowance (learned): when it
    /// began, in real time, and the allowance.
    short: Option<(Instant, Duration)>,
    waking: bool,
    /// Tokio's time when it began: an attempt that ends within the hold with tokio's clock
    /// moved was answered in virtual time (the hold began before its task ran), not from
    /// elsewhere in real time.
    began: tokio::time::Instant,
}

/// What a hold does when its grace runs out.
enum Wake {
    /// Nothing: the hold of an attempt's start; shorter than its allowance, when it began and
    /// the allowance.
    Later(Option<(Instant, Duration)>),
    /// Wakes the task of a timer that fired early, waiting the rest of its allowance.
    Task(std::task::Waker),
}

impl Hold {
    fn start(grace: Duration, learned: Arc<Grace>, wake: Wake) -> Hold {
        let (waker, short) = match wake {
            Wake::Later(short) => (None, short),
            Wake::Task(waker) => (Some(waker), None),
        };
        let state = Arc::new(HoldState {
            flags: Mutex::new((false, false)),
            wakeup: Condvar::new(),
            grace: learned,
            waking: waker.is_some(),
            waker: Mutex::new(waker),
            short,
            began: tokio::time::Instant::now(),
        });
        let held = state.clone();
        // Detached: it ends when its grace is over or when it is told.
        drop(tokio::task::spawn_blocking(move || {
            let ends = Instant::now() + grace;
            let mut flags = held.flags.lock().unwrap_or_else(|e| e.into_inner());
            while !flags.0 {
                let left = ends.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    flags.1 = true;
                    drop(flags);
                    held.grace.ran_out();
                    let waker = held.waker.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(waker) = waker {
                        waker.wake();
                    }
                    return;
                }
                flags = held
                    .wakeup
                    .wait_timeout(flags, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }));
        Hold { state }
    }

    /// When a short hold at its attempt's start began, and the attempt's allowance.
    fn short(&self) -> Option<(Instant, Duration)> {
        self.state.short
    }

    /// Whether it wakes its task when it runs out: the rest of a grace, after a timer fired.
    fn waking(&self) -> bool {
        self.state.waking
    }

    /// Whether the grace ran out; if not, `cx`'s task is woken when it does.
    fn ran_out(&self, cx: &Context<'_>) -> bool {
        let mut waker = self.state.waker.lock().unwrap_or_else(|e| e.into_inner());
        let flags = self.state.flags.lock().unwrap_or_else(|e| e.into_inner());
        if flags.1 {
            return true;
        }
        *waker = Some(cx.waker().clone());
        false
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut flags = self.state.flags.lock().unwrap_or_else(|e| e.into_inner());
        if !flags.1 {
            if tokio::time::Instant::now() != self.state.began {
                // Ended within its grace with tokio's clock moved: answered in virtual time
                // (the hold began before its task ran).
                self.state.grace.ran_out();
            } else if self.state.waking {
                // The rest of a short hold, ended by the attempt's answer from elsewhere in
                // real time: the hold learned was too short.
                self.state.grace.answered();
            }
        }
        flags.0 = true;
        drop(flags);
        self.state.wakeup.notify_one();
    }
}

/// How many of tokio's timers a thread keeps armed for the attempts to come.
const SPARE_TIMERS: usize = 64;

/// tokio's timers that ended with their attempt, kept on the thread that dropped them, still in
/// the timer wheel, for the runtime they belong to (a thread keeps one runtime's: another's
/// replace them).
///
/// Making a tokio timer, putting it in the wheel and taking it out again costs more than the
/// rest of a successful attempt's bookkeeping together: the wheel is behind a lock, taken twice.
/// A spare one is moved to the next attempt's later deadline with one atomic operation (tokio
/// files it anew only when its old deadline comes), so attempts that follow one another on a
/// thread arm no timer of their own. An idle spare fires once at its last deadline and leaves
/// the wheel.
struct Spares {
    runtime: Option<tokio::runtime::Id>,
    timers: Vec<(Pin<Box<tokio::time::Sleep>>, Registered)>,
}

/// Whose waker a tokio timer last took, when it was polled: the waker's data and vtable
/// addresses (`[0, 0]`: none). The timer holds a clone of that waker, so while it does no other
/// waker can have the same addresses: equal addresses are the same task's.
type Registered = [usize; 2];

/// The addresses that tell `waker` apart (see [`Registered`]).
fn registered(waker: &std::task::Waker) -> Registered {
    [
        waker.data() as usize,
        std::ptr::from_ref(waker.vtable()) as usize,
    ]
}

thread_local! {
    static SPARES: std::cell::RefCell<Spares> = const {
        std::cell::RefCell::new(Spares { runtime: None, timers: Vec::new() })
    };
}

/// One attempt's tokio timer: a spare, or a new one; it goes back to the spares when the
/// attempt ends.
///
/// A spare whose deadline is earlier than the attempt's is not moved at once: it fires early,
/// once, and is then moved to the attempt's deadline. Attempts that follow one another with the
/// same timeout thus move a spare once per timeout, not once per attempt.
pub(crate) struct Armed {
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    runtime: tokio::runtime::Id,
    /// Whose waker the timer holds: a spare that attempts of one task take in turn is polled
    /// again only when it fired or another task waits on it (see [`Armed::poll`]).
    registered: Registered,
}

impl Armed {
    /// A timer for `deadline` (`None`: `duration` from now, beyond the `Instant` range), on the
    /// current runtime (panics outside one, or on one without a time driver, as tokio does).
    fn until(deadline: Option<tokio::time::Instant>, duration: Duration) -> Armed {
        let runtime = tokio::runtime::Handle::current().id();
        let spare = deadline.and_then(|_| {
            SPARES
                .try_with(|spares| {
                    let mut spares = spares.borrow_mut();
                    (spares.runtime == Some(runtime))
                        .then(|| spares.timers.pop())
                        .flatten()
                })
                .ok()
                .flatten()
        });
        let (sleep, registered) = match (spare, deadline) {
            (Some((mut sleep, registered)), Some(deadline)) => {
                // Later than this attempt's: it would fire too late, so it is moved now (it
                // keeps the waker it holds).
                if sleep.deadline() > deadline {
                    sleep.as_mut().reset(deadline);
                }
                (sleep, registered)
            }
            (_, Some(deadline)) => (Box::pin(tokio::time::sleep_until(deadline)), [0; 2]),
            // Beyond the `Instant` range: tokio's own far deadline.
            (_, None) => (Box::pin(tokio::time::sleep(duration)), [0; 2]),
        };
        Armed {
            sleep: Some(sleep),
            runtime,
            registered,
        }
    }

    /// Ready when tokio's clock has reached `deadline`, the one it was armed for (`None`:
    /// beyond the `Instant` range).
    fn poll(&mut self, cx: &mut Context<'_>, deadline: Option<tokio::time::Instant>) -> Poll<()> {
        let Some(sleep) = &mut self.sleep else {
            return Poll::Pending;
        };
        let waker = registered(cx.waker());
        // Still armed, and holding this task's waker: polling it again would change nothing
        // (tokio keeps a waker that wakes the same task), so it is not.
        if self.registered == waker && !sleep.is_elapsed() {
            return Poll::Pending;
        }
        self.registered = waker;
        let fired = match sleep.as_mut().poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(()) => match deadline {
                // A spare that fired at an earlier attempt's deadline: moved to this one's.
                // tokio fires it no earlier than that on its clock, so this happens once.
                Some(deadline) if tokio::time::Instant::now() < deadline => {
                    sleep.as_mut().reset(deadline);
                    sleep.as_mut().poll(cx)
                }
                _ => Poll::Ready(()),
            },
        };
        if fired.is_ready() {
            // A timer that fired has woken, and let go of, the waker it held.
            self.registered = [0; 2];
        }
        fired
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        let Some(sleep) = self.sleep.take() else {
            return;
        };
        // Kept only while this thread's spares are for this runtime, or it has none; otherwise
        // (or while the thread ends) dropped, which takes it out of the wheel.
        let _ = SPARES.try_with(|spares| {
            let mut spares = spares.borrow_mut();
            if spares.runtime != Some(self.runtime) {
                // Another runtime's spares (one that ended, most likely) make way.
                spares.timers.clear();
                spares.runtime = Some(self.runtime);
            }
            if spares.timers.len() < SPARE_TIMERS {
                spares.timers.push((sleep, self.registered));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{SharedClock, TimerUnavailable};

    /// Issue 64, defect 11: a runtime learns how long its attempts hold tokio's auto-advance:
    /// a quarter after each hold that ran out unanswered, down to 2 ms; the whole grace again
    /// once an attempt is answered within its hold.
    #[tokio::test]
    async fn a_runtime_s_grace_shrinks_when_holds_run_out_and_comes_back_when_one_is_answered() {
        let grace = Grace::of_runtime();
        assert!(Arc::ptr_eq(&grace, &Grace::of_runtime()), "one per runtime");
        assert_eq!(grace.now(), PAUSED_GRACE);
        let seen: Vec<Duration> = (0..4)
            .map(|_| {
                grace.ran_out();
                grace.now()
            })
            .collect();
        let ms = Duration::from_millis;
        assert_eq!(seen, [ms(25), Duration::from_micros(6250), ms(2), ms(2)]);
        grace.answered();
        assert_eq!(grace.now(), PAUSED_GRACE);
        // Another runtime learns apart.
        let other = std::thread::spawn(|| {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async { Grace::of_runtime().now() })
        });
        grace.ran_out();
        assert_eq!(other.join().unwrap(), PAUSED_GRACE);
    }

    /// A timeout whose short hold (learned) let its timer fire early waits the rest of the
    /// whole allowance of real time, however often it is polled meanwhile, then fires.
    #[tokio::test(start_paused = true)]
    async fn a_timer_that_fired_early_waits_the_rest_of_its_allowance_however_polled() {
        let grace = Grace::of_runtime();
        for _ in 0..4 {
            grace.ran_out();
        }
        assert_eq!(grace.now(), LEAST_GRACE);
        let began = Instant::now();
        let mut timeout = Box::pin(TokioTimeout::new(Duration::from_millis(50), None));
        tokio::time::advance(Duration::from_millis(50)).await;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        // Polled again and again before its allowance: still waiting (a spurious wake-up
        // must not end it).
        let mut polls = 0;
        while began.elapsed() < Duration::from_millis(40) {
            assert!(
                timeout.as_mut().poll(&mut cx).is_pending(),
                "{:?}",
                began.elapsed()
            );
            polls += 1;
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(polls > 1);
        // Bounded: the allowance (50 ms) runs out in real time.
        let mut fired = false;
        for _ in 0..500 {
            if timeout.as_mut().poll(&mut cx).is_ready() {
                fired = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(fired, "the timer fires once its allowance ran out");
        assert!(began.elapsed() >= Duration::from_millis(50));
    }

    /// A hold that runs out tells its runtime; so does the rest of a short hold dropped within
    /// its grace (its attempt answered from elsewhere).
    #[tokio::test(start_paused = true)]
    async fn a_hold_tells_its_runtime_how_it_ended() {
        let grace = Grace::of_runtime();
        grace.answered();
        let hold = Hold::start(Duration::from_millis(5), grace.clone(), Wake::Later(None));
        // Bounded: the hold runs out after 5 ms of real time.
        for _ in 0..200 {
            if grace.now() < PAUSED_GRACE {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(grace.now(), Duration::from_millis(25), "ran out");
        drop(hold);
        assert_eq!(
            grace.now(),
            Duration::from_millis(25),
            "dropped after: nothing said"
        );
        let answered = Hold::start(Duration::from_secs(5), grace.clone(), Wake::Later(None));
        drop(answered);
        assert_eq!(
            grace.now(),
            Duration::from_millis(25),
            "an attempt's hold: nothing said"
        );
        let waker = std::task::Waker::noop().clone();
        let rest = Hold::start(Duration::from_secs(5), grace.clone(), Wake::Task(waker));
        drop(rest);
        assert_eq!(
            grace.now(),
            PAUSED_GRACE,
            "the rest of a short hold, answered"
        );
        // Tokio's clock moved within a hold: its attempt was answered in virtual time.
        let moved = Hold::start(Duration::from_secs(5), grace.clone(), Wake::Later(None));
        tokio::time::advance(Duration::from_millis(1)).await;
        drop(moved);
        assert_eq!(
            grace.now(),
            Duration::from_millis(25),
            "answered in virtual time"
        );
    }

    /// How many spare timers this thread keeps, and for which runtime.
    /// Aborts the test binary if it is still alive after 10 s of real time: a timer that never
    /// fires ends the run at once instead of hanging it (tokio's own clock may be paused, so
    /// the watch is a thread of its own). Dropping it ends the watch.
    struct Watchdog(#[allow(dead_code)] std::sync::mpsc::Sender<()>);

    impl Watchdog {
        fn start() -> Watchdog {
            let (done, watched) = std::sync::mpsc::channel::<()>();
            std::thread::spawn(move || {
                let limit = Duration::from_secs(10);
                if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = watched.recv_timeout(limit)
                {
                    eprintln!("a timer did not fire within {limit:?} of real time");
                    std::process::abort();
                }
            });
            Watchdog(done)
        }
    }

    fn spares() -> (usize, Option<tokio::runtime::Id>) {
        SPARES.with(|s| {
            let s = s.borrow();
            (s.timers.len(), s.runtime)
        })
    }

    #[tokio::test]
    async fn an_ended_attempt_s_timer_is_kept_and_the_next_attempt_takes_it() {
        let runtime = tokio::runtime::Handle::current().id();
        drop(TokioTimeout::new(Duration::from_secs(30), None));
        assert_eq!(spares(), (1, Some(runtime)));
        let next = TokioTimeout::new(Duration::from_secs(30), None);
        assert_eq!(spares().0, 0, "taken, not made anew");
        drop(next);
        assert_eq!(spares().0, 1);
    }

    #[tokio::test]
    async fn a_thread_keeps_a_bounded_number_of_spares() {
        let many: Vec<_> = (0..SPARE_TIMERS + 5)
            .map(|_| TokioTimeout::new(Duration::from_secs(30), None))
            .collect();
        drop(many);
        assert_eq!(spares().0, SPARE_TIMERS);
    }

    #[tokio::test]
    async fn a_spare_set_for_an_earlier_deadline_fires_only_at_the_new_one() {
        let _watchdog = Watchdog::start();
        drop(TokioTimeout::new(Duration::from_millis(10), None));
        let started = Instant::now();
        let mut timeout = TokioTimeout::new(Duration::from_millis(60), None);
        assert_eq!(spares().0, 0, "the spare was taken");
        (&mut timeout).await;
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(60), "{took:?}");
        assert!(timeout.hold.is_none(), "a running clock holds nothing");
    }

    #[tokio::test]
    async fn a_spare_set_for_a_later_deadline_is_moved_to_the_earlier_one() {
        drop(TokioTimeout::new(Duration::from_secs(30), None));
        let started = Instant::now();
        let timeout = TokioTimeout::new(Duration::from_millis(20), None);
        assert_eq!(spares().0, 0, "the spare was taken");
        // Bounded: a spare left at its 30 s deadline would fail here, not hang.
        tokio::time::timeout(Duration::from_secs(5), timeout)
            .await
            .expect("the timeout fired at its own deadline");
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(20), "{took:?}");
    }

    /// A clock paused after the timer was armed: the timer is tokio's, and fires at its own
    /// deadline on that clock, not at the earlier one its spare was set for.
    #[tokio::test]
    async fn a_clock_paused_under_a_spare_set_for_an_earlier_deadline_fires_at_its_own() {
        let _watchdog = Watchdog::start();
        drop(TokioTimeout::new(Duration::from_millis(5), None));
        let start = tokio::time::Instant::now();
        let timeout = TokioTimeout::new(Duration::from_millis(40), None);
        tokio::time::pause();
        timeout.await;
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(40), "{took:?}");
    }

    #[tokio::test]
    async fn a_spare_that_fired_while_kept_is_armed_again() {
        let _watchdog = Watchdog::start();
        drop(TokioTimeout::new(Duration::from_millis(1), None));
        // Long enough for tokio to fire the kept timer (its tick is a millisecond).
        tokio::time::sleep(Duration::from_millis(20)).await;
        let started = Instant::now();
        TokioTimeout::new(Duration::from_millis(30), None).await;
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(30), "{took:?}");
    }

    #[test]
    fn another_runtime_on_the_same_thread_does_not_take_an_ended_runtime_s_spares() {
        let _watchdog = Watchdog::start();
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let first_id = first.handle().id();
        first.block_on(async {
            drop(TokioTimeout::new(Duration::from_secs(30), None));
        });
        drop(first);
        assert_eq!(spares(), (1, Some(first_id)));
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let second_id = second.handle().id();
        second.block_on(async {
            let started = Instant::now();
            // A spare of the ended runtime would panic when polled, or never fire.
            let timeout = TokioTimeout::new(Duration::from_millis(20), None);
            assert_eq!(spares(), (1, Some(first_id)), "not taken");
            timeout.await;
            assert!(started.elapsed() >= Duration::from_millis(20));
        });
        assert_eq!(spares(), (1, Some(second_id)), "replaced by this runtime's");
    }

    #[tokio::test]
    async fn a_running_tokio_clock_times_attempts_on_tokio_s_timer() {
        let _watchdog = Watchdog::start();
        let started = Instant::now();
        let timeout = TokioTimeout::new(Duration::from_millis(20), None);
        assert!(timeout.hold.is_none());
        timeout.await;
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(20), "{took:?}");
    }

    /// Under a paused clock the timeout is tokio's own, in virtual time; auto-advance is held
    /// for the grace only, then moves the clock to it.
    #[tokio::test(start_paused = true)]
    async fn a_paused_tokio_clock_times_attempts_in_virtual_time_after_a_grace() {
        let _watchdog = Watchdog::start();
        let (real, virtual_) = (Instant::now(), tokio::time::Instant::now());
        let timeout = TokioTimeout::new(Duration::from_secs(30), None);
        assert!(timeout.hold.is_some());
        timeout.await;
        assert_eq!(virtual_.elapsed(), Duration::from_secs(30));
        let took = real.elapsed();
        assert!(took >= PAUSED_GRACE, "auto-advance was held: {took:?}");
        assert!(
            took < Duration::from_secs(10),
            "not 30 s of real time: {took:?}"
        );
    }

    /// While the grace lasts, virtual time stands still: a server elsewhere is answered before
    /// any timer of the runtime's moves it.
    #[tokio::test(start_paused = true)]
    async fn within_the_grace_a_paused_clock_does_not_move() {
        let _watchdog = Watchdog::start();
        let virtual_ = tokio::time::Instant::now();
        let _timeout = TokioTimeout::new(Duration::from_secs(30), None);
        let elsewhere =
            tokio::task::spawn_blocking(|| std::thread::sleep(Duration::from_millis(20)));
        // The caller's own timer of a second does not fire while the hold lasts.
        let first = tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => "timer",
            _ = elsewhere => "elsewhere",
        };
        assert_eq!(first, "elsewhere");
        assert_eq!(virtual_.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn an_earlier_reading_of_a_paused_clock_is_enough_to_tell_it_is_paused() {
        let read = TokioClock.now();
        let timeout = TokioTimeout::new(Duration::from_millis(5), Some(read));
        assert!(timeout.hold.is_some());
    }

    #[tokio::test]
    async fn an_earlier_reading_of_a_running_clock_is_enough_to_tell_it_runs() {
        let read = TokioClock.now();
        let timeout = TokioTimeout::new(Duration::from_millis(5), Some(read));
        assert!(timeout.hold.is_none(), "a running clock holds nothing");
        // Armed from a reading after the one passed in.
        let deadline = timeout
            .deadline
            .expect("a 5 ms deadline is in range")
            .into_std();
        assert!(deadline > read + Duration::from_millis(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_timeout_lets_tokio_auto_advance_again() {
        let timeout = TokioTimeout::new(Duration::from_secs(30), None);
        assert!(timeout.hold.is_some());
        drop(timeout);
        // While a blocking task runs, tokio does not auto-advance: a hold that outlived its
        // drop would keep this 1 s virtual sleep for its grace of real time.
        let real = Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(real.elapsed() < PAUSED_GRACE / 2, "{:?}", real.elapsed());
    }

    #[test]
    fn a_runtime_without_a_timer_gets_an_error_even_with_another_runtime_s_spares_on_the_thread() {
        let timed = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        timed.block_on(async { drop(TokioTimeout::new(Duration::from_secs(30), None)) });
        assert_eq!(spares().0, 1);
        let untimed = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        untimed.block_on(async {
            let clock = SharedClock::new(TokioClock::new());
            assert!(matches!(
                clock.timeout(Duration::from_secs(1), None),
                Err(TimerUnavailable)
            ));
        });
        assert_eq!(spares().0, 1, "the other runtime's spare was not taken");
    }

    #[tokio::test]
    async fn a_new_timer_is_polled_and_fires() {
        let _watchdog = Watchdog::start();
        let started = Instant::now();
        let timeout = TokioTimeout::new(Duration::from_millis(20), None);
        assert_eq!(
            timeout.sleep.registered, [0; 2],
            "a new timer holds no waker"
        );
        timeout.await;
        assert!(started.elapsed() >= Duration::from_millis(20));
    }

    #[tokio::test]
    async fn a_spare_another_task_waited_on_wakes_the_task_that_takes_it() {
        let _watchdog = Watchdog::start();
        // The first task waits on its timer, which then holds its waker, and ends: the spare
        // goes back still holding that task's waker.
        let first = tokio::spawn(async {
            let mut timeout = TokioTimeout::new(Duration::from_secs(30), None);
            let pending = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut timeout).poll(cx)));
            assert!(pending.await.is_pending());
        });
        first.await.unwrap();
        assert_eq!(spares().0, 1);
        // Another task takes it: the timer must take this task's waker, or it never wakes it.
        let started = Instant::now();
        tokio::spawn(TokioTimeout::new(Duration::from_millis(20), None))
            .await
            .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(20));
    }

    #[tokio::test]
    async fn a_spare_one_task_waited_on_is_not_polled_again_by_it() {
        let _watchdog = Watchdog::start();
        let mut timeout = TokioTimeout::new(Duration::from_millis(30), None);
        let started = Instant::now();
        let polled = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut timeout).poll(cx)));
        assert!(polled.await.is_pending());
        assert_ne!(
            timeout.sleep.registered, [0; 2],
            "it holds this task's waker"
        );
        drop(timeout);
        // The next attempt of the same task takes the spare, skips tokio's poll, and is still
        // woken at its own deadline.
        let next = TokioTimeout::new(Duration::from_millis(40), None);
        assert_ne!(
            next.sleep.registered, [0; 2],
            "the spare came with this task's waker"
        );
        next.await;
        assert!(started.elapsed() >= Duration::from_millis(40));
    }

    #[tokio::test]
    async fn a_spare_from_an_attempt_dropped_while_it_waited_times_the_next_attempt() {
        // The first attempt's task waits on its timer, then is dropped: the timer goes back to
        // the spares with that task's waker registered in it.
        let waiting = tokio::spawn(TokioTimeout::new(Duration::from_secs(30), None));
        tokio::task::yield_now().await;
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(spares().0, 1);
        let started = Instant::now();
        let next = tokio::spawn(TokioTimeout::new(Duration::from_millis(20), None));
        tokio::time::timeout(Duration::from_secs(5), next)
            .await
            .expect("the next attempt's timeout fired")
            .unwrap();
        assert!(started.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn the_stored_clock_debugs_without_the_user_s_type() {
        assert_eq!(
            format!("{:?}", SharedClock::new(TokioClock::new())),
            "Clock"
        );
    }

    /// A clock of the user's whose sleeps end at once.
    #[derive(Debug)]
    struct Instantly;

    impl Clock for Instantly {
        fn now(&self) -> Instant {
            Instant::now()
        }
        fn wall_now(&self) -> SystemTime {
            SystemTime::now()
        }
        fn sleep(&self, _: Duration) -> Sleep {
            Box::pin(async {})
        }
        fn timeout(&self, _: Duration) -> Sleep {
            Box::pin(std::future::pending())
        }
    }

    #[tokio::test]
    async fn a_wait_on_another_clock_is_that_clock_s_sleep_not_tokio_s() {
        let _watchdog = Watchdog::start();
        let clock = SharedClock::new(Instantly);
        let started = Instant::now();
        // An hour on a clock whose sleeps end at once: no real time.
        clock.wait(Duration::from_secs(3600)).await.unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        // And a wait on tokio's clock is tokio's sleep.
        let tokio = SharedClock::new(TokioClock::new());
        tokio::time::pause();
        let virtual_start = tokio::time::Instant::now();
        tokio.wait(Duration::from_secs(3600)).await.unwrap();
        let waited = virtual_start.elapsed();
        assert!(waited >= Duration::from_secs(3600), "{waited:?}");
        assert!(waited < Duration::from_secs(3601), "{waited:?}");
    }

    #[test]
    fn tokio_s_clock_without_a_runtime_timer_is_an_error_not_a_panic() {
        let no_timer = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        no_timer.block_on(async {
            let clock = SharedClock::new(TokioClock::new());
            assert!(matches!(
                clock.timeout(Duration::from_secs(1), None),
                Err(TimerUnavailable)
            ));
        });
    }
}
