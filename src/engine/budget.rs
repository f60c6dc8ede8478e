//! A retry budget: a token bucket shared by every request to one dependency.
//!
//! The rules, why a budget and how it meets time are on [`RetryBudget`], where they render.

use crate::clock::Instant;
use std::fmt;
use std::sync::{Arc, OnceLock};

use crate::error::InvalidConfig;

/// The area named in this module's configuration errors.
const BUDGET: &str = "retry budget";

#[cfg(not(reqwest_safe_retry_loom))]
use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(reqwest_safe_retry_loom)]
use loom::sync::atomic::{AtomicU64, Ordering};

/// Milli-tokens per token.
const MILLI: u64 = 1_000;

/// What kind of failure a retry follows; kinds may cost differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum RetryKind {
    /// A throttling answer (429): the server is shedding load on purpose and will recover.
    Throttled,
    /// A timeout: the most expensive kind of failure for a struggling server.
    Timeout,
    /// Any other transient failure.
    Other,
}

/// A shared retry budget: a lock-free token bucket. Clones share the same bucket.
///
/// Every [`Dependency`](crate::Dependency) has one of its own, [`RetryBudget::default()`]; set one
/// with [`Dependency::with_budget`](crate::Dependency::with_budget) to choose its size, or to
/// share one account between dependencies that call the same service (clients in different
/// parts of a program, say).
///
/// Four ways to make one, each for its own need: [`default()`](Self::default) for about 10 %
/// extra load, [`ratio`](Self::ratio) for another share, [`aws_like`](Self::aws_like) for the
/// AWS SDKs' accounting, and [`builder`](Self::builder) (which starts from `default()`'s settings)
/// to set each amount.
///
/// ```
/// use reqwest_safe_retry::{Dependency, RetryBudget, RetryMiddleware, RetryPolicy};
///
/// let shared = RetryBudget::ratio(0.05)?; // retries add at most about 5 % to the load
/// let orders = Dependency::new("orders", RetryPolicy::default()).with_budget(shared.clone());
/// let refunds = Dependency::new("refunds", RetryPolicy::default()).with_budget(shared.clone());
/// let middleware = RetryMiddleware::new(orders).route("refunds.internal", refunds)?;
/// assert_eq!(shared.balance(), 10.0); // both dependencies draw on these 10 tokens
/// # drop(middleware);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
///
/// # Why a budget and not only a maximum number of attempts
///
/// "Three attempts" is harmless while a dependency is healthy and ruinous when it is not: every
/// request then becomes three, at the moment the dependency can least take it, and three layers
/// of such clients make it twenty-seven. A budget bounds the *extra* load instead. Retries spend
/// tokens; requests that go well earn them. While the dependency is healthy there are plenty of
/// tokens and every transient failure is retried; during an outage nothing earns tokens, the
/// bucket runs dry after a small burst, and the load tends to the offered load, not to a
/// multiple of it.
///
/// # Rules
///
/// - A first attempt never needs a token: the budget limits retries only.
/// - A retry withdraws its cost *before* it sleeps (charge-before-sleep). Charging after the
///   sleep would let a thousand failing requests all decide to retry against a bucket that can pay
///   for ten; charging first means the number of retries waiting in backoff never exceeds what the
///   bucket holds. A refused withdrawal ends the logical request with its last outcome and
///   [`StopReason::BudgetExhausted`](crate::StopReason::BudgetExhausted).
/// - A retry that was paid for but never started (the caller dropped the request during its
///   backoff, or the deadline passed during the wait) gives its tokens back:
///   tokens pay for retries that were made, nothing else.
/// - A first attempt that the dependency answered with a response that is not a transient
///   failure deposits (its answer may still be a 404). A first attempt that ended in an error
///   (nothing reached the dependency, or nothing came back from it: a transport error, a
///   redirect loop, another middleware's error) earns nothing. The balance never exceeds the
///   capacity.
/// - Optionally, a success after retries refunds what its last retry cost, and a small time-based
///   floor earns tokens with the passing of time, so that a client too quiet to earn tokens can
///   still retry now and then. The floor is also the one way tokens appear during a total outage,
///   so it adds at most `floor_per_sec` retries per second to the offered load.
///
/// # Time
///
/// The budget has no clock of its own: every withdrawal passes the time of the clock of the
/// middleware that makes it (a `FakeClock` in tests), and the floor counts from the first time
/// it is given. So a budget built long before its first use earns nothing for that wait, and a
/// test on virtual time never sees real time leak into it.
///
/// Balances are integers in milli-tokens, updated with compare-and-swap on one atomic: no lock,
/// no float rounding, and exact accounting under any interleaving.
///
/// # Bursts, and tests of concurrency
///
/// The default bucket holds 10 tokens. A burst of failures spends them at once: 20 concurrent
/// requests that all meet a 503 make 10 retries between them, and the other ten stop after one
/// attempt with [`StopReason::BudgetExhausted`](crate::StopReason::BudgetExhausted) (whose
/// error message names the bucket's size). That is the budget at work, not a fault. A
/// dependency that meets such bursts in normal operation gets a larger bucket
/// (`RetryBudget::builder().capacity(100.0).build()?`); a test of concurrent retries sizes it
/// for the test, or turns it off with
/// [`Dependency::without_budget`](crate::Dependency::without_budget).
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    config: Config,
    tokens: Tokens,
    /// The floor's last refill, in nanoseconds since `origin`.
    refilled_at: AtomicU64,
    /// The first time a withdrawal passed: the floor counts from there.
    origin: OnceLock<Instant>,
    retries: AtomicU64,
    refusals: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Config {
    capacity: u64,
    initial: u64,
    retry_cost: u64,
    timeout_cost: u64,
    throttled_cost: u64,
    deposit: u64,
    refund: bool,
    floor_per_sec: u64,
}

impl RetryBudget {
    /// A ratio budget: retries may add about `ratio` of the successful load (0.1: 10 %).
    ///
    /// Each first attempt that does not fail transiently deposits `ratio` tokens; a retry costs
    /// one. The bucket holds 10 tokens, starts full, and the floor earns one token a second.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] unless `0.001 <= ratio <= 1000` (a deposit below 0.001 tokens is below
    /// the budget's resolution).
    pub fn ratio(ratio: f64) -> Result<RetryBudget, InvalidConfig> {
        RetryBudget::builder().deposit_ratio(ratio).build()
    }

    /// A bucket in the manner of the AWS SDKs' standard retry mode: 500 tokens, starting full; a
    /// retry costs 5 (10 after a timeout, 1 after a 429); a first attempt that goes well returns
    /// 1; a success after retries refunds what its last retry cost. No time floor.
    pub fn aws_like() -> RetryBudget {
        RetryBudget::from_config(Config {
            capacity: 500 * MILLI,
            initial: 500 * MILLI,
            retry_cost: 5 * MILLI,
            timeout_cost: 10 * MILLI,
            throttled_cost: MILLI,
            deposit: MILLI,
            refund: true,
            floor_per_sec: 0,
        })
    }

    /// Starts a builder from the default ratio budget's settings.
    pub fn builder() -> RetryBudgetBuilder {
        RetryBudgetBuilder::new()
    }

    fn from_config(config: Config) -> RetryBudget {
        RetryBudget {
            inner: Arc::new(Inner {
                config,
                tokens: Tokens::new(config.initial),
                refilled_at: AtomicU64::new(0),
                origin: OnceLock::new(),
                retries: AtomicU64::new(0),
                refusals: AtomicU64::new(0),
            }),
        }
    }

    /// The tokens in the bucket now.
    pub fn balance(&self) -> f64 {
        self.inner.tokens.get() as f64 / MILLI as f64
    }

    /// The balance in milli-tokens, exactly.
    #[cfg(test)]
    pub(crate) fn balance_milli(&self) -> u64 {
        self.inner.tokens.get()
    }

    /// The bucket's capacity, in tokens.
    pub fn capacity(&self) -> f64 {
        self.inner.config.capacity as f64 / MILLI as f64
    }

    /// Retries the budget has paid for.
    #[cfg(test)]
    pub(crate) fn retries(&self) -> u64 {
        self.inner.retries.load(Ordering::Relaxed)
    }

    /// Retries the budget has refused.
    #[cfg(test)]
    pub(crate) fn refusals(&self) -> u64 {
        self.inner.refusals.load(Ordering::Relaxed)
    }

    /// Whether `other` is a clone of this budget (the same bucket).
    #[cfg(test)]
    pub(crate) fn same_bucket(&self, other: &RetryBudget) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Withdraws the cost of one retry after a failure of `kind`, or refuses it; returns the cost
    /// paid, in milli-tokens. `now` is the caller's clock reading, for the time floor.
    pub(crate) fn try_withdraw(&self, kind: RetryKind, now: Instant) -> Option<u64> {
        let inner = &*self.inner;
        inner.refill(now);
        let cost = match kind {
            RetryKind::Throttled => inner.config.throttled_cost,
            RetryKind::Timeout => inner.config.timeout_cost,
            RetryKind::Other => inner.config.retry_cost,
        };
        if inner.tokens.withdraw(cost) {
            inner.retries.fetch_add(1, Ordering::Relaxed);
            Some(cost)
        } else {
            inner.refusals.fetch_add(1, Ordering::Relaxed);
            None
        }
    }

    /// Gives back `cost` milli-tokens from a withdrawal whose retry was never started (the
    /// request was dropped during its backoff, or stopped before the attempt): the balance gets
    /// them back (up to the capacity) and the count of retries paid for no longer counts it.
    pub(crate) fn cancel_withdrawal(&self, cost: u64) {
        let inner = &*self.inner;
        inner.tokens.deposit(cost, inner.config.capacity);
        // Saturating: a cancel without its withdrawal must not wrap the count.
        let _ = inner
            .retries
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Records a first attempt that the dependency answered with a response that is not a
    /// transient failure: deposits the configured amount.
    ///
    /// This is all a success costs the budget: one atomic load while the bucket is full (the
    /// usual state of a healthy dependency), one compare-and-swap while it refills.
    pub(crate) fn deposit_first_attempt(&self) {
        let inner = &*self.inner;
        let (amount, capacity) = (inner.config.deposit, inner.config.capacity);
        if amount > 0 && inner.tokens.get() < capacity {
            inner.tokens.deposit(amount, capacity);
        }
    }

    /// Records a success (a response below 400) after retries whose last retry cost `cost`
    /// milli-tokens: refunds it if the budget refunds on success.
    pub(crate) fn refund(&self, cost: u64) {
        let inner = &*self.inner;
        if inner.config.refund {
            inner.tokens.deposit(cost, inner.config.capacity);
        }
    }
}

impl Inner {
    /// Earns the floor's tokens for the time since the last refill.
    fn refill(&self, now: Instant) {
        let rate = self.config.floor_per_sec;
        if rate == 0 {
            return;
        }
        let origin = *self.origin.get_or_init(|| now);
        let now =
            u64::try_from(now.saturating_duration_since(origin).as_nanos()).unwrap_or(u64::MAX);
        let last = self.refilled_at.load(Ordering::Acquire);
        if now <= last {
            return;
        }
        // milli-tokens = nanoseconds * (milli-tokens per second) / 1e9, in u128 to not overflow.
        let earned = u128::from(now - last) * u128::from(rate) / 1_000_000_000;
        if earned == 0 {
            return;
        }
        // Advance the mark only by the time the earned tokens stand for, so fractions carry over.
        let used = u64::try_from(earned * 1_000_000_000 / u128::from(rate)).unwrap_or(u64::MAX);
        if self
            .refilled_at
            .compare_exchange(
                last,
                last.saturating_add(used),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            let earned = u64::try_from(earned).unwrap_or(u64::MAX);
            self.tokens.deposit(earned, self.config.capacity);
        }
    }
}

impl Default for RetryBudget {
    /// The ratio budget of [`RetryBudget::ratio`] with a ratio of 0.1.
    fn default() -> Self {
        RetryBudget::from_config(RetryBudgetBuilder::new().config)
    }
}

impl fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBudget")
            .field("balance", &self.balance())
            .field("capacity", &self.capacity())
            .field("retries", &self.inner.retries.load(Ordering::Relaxed))
            .field("refusals", &self.inner.refusals.load(Ordering::Relaxed))
            .finish()
    }
}

/// Builds a [`RetryBudget`]. Amounts are in tokens; a retry of the default kind costs
/// [`retry_cost`](Self::retry_cost).
///
/// # Default
///
/// | setting | default |
/// |---|---|
/// | [`capacity`](Self::capacity) | 10 tokens |
/// | [`initial`](Self::initial) | full (the capacity) |
/// | [`retry_cost`](Self::retry_cost) | 1 token |
/// | [`timeout_cost`](Self::timeout_cost) | 1 token |
/// | [`throttled_cost`](Self::throttled_cost) | 1 token |
/// | [`deposit_ratio`](Self::deposit_ratio) | 0.1 token per first attempt that goes well |
/// | [`refund_on_success`](Self::refund_on_success) | off |
/// | [`floor_per_sec`](Self::floor_per_sec) | 1 token per second |
#[derive(Debug, Clone)]
pub struct RetryBudgetBuilder {
    config: Config,
    initial_set: bool,
    /// The deposit as a fraction of `retry_cost`, applied in `build()` so the order of the
    /// setters does not matter.
    deposit_ratio: f64,
    invalid: Option<String>,
}

/// The largest amount a setting takes, in tokens: far beyond any sensible bucket, and small
/// enough that sums of milli-tokens never come near `u64::MAX`.
const MOST_TOKENS: f64 = 1e12;

impl RetryBudgetBuilder {
    fn new() -> Self {
        RetryBudgetBuilder {
            config: Config {
                capacity: 10 * MILLI,
                initial: 10 * MILLI,
                retry_cost: MILLI,
                timeout_cost: MILLI,
                throttled_cost: MILLI,
                deposit: MILLI / 10,
                refund: false,
                floor_per_sec: MILLI,
            },
            initial_set: false,
            deposit_ratio: 0.1,
            invalid: None,
        }
    }

    /// Converts `tokens` to milli-tokens, or records why it cannot be one. `positive`: zero is
    /// refused too.
    fn milli(&mut self, name: &str, tokens: f64, positive: bool) -> u64 {
        let milli = tokens * MILLI as f64;
        let fits = tokens.is_finite() && (0.0..=MOST_TOKENS).contains(&tokens);
        if !fits || (positive && milli.round() < 1.0) {
            let least = if positive { "0.001" } else { "0" };
            self.invalid.get_or_insert_with(|| {
                format!("{name} must be a number of tokens from {least} to 1e12, not {tokens}")
            });
            return 0;
        }
        milli.round() as u64
    }

    /// The most tokens the bucket holds. Must be at least one retry's cost.
    pub fn capacity(mut self, tokens: f64) -> Self {
        self.config.capacity = self.milli("capacity", tokens, true);
        self
    }

    /// The tokens in the bucket at the start; at most the capacity.
    pub fn initial(mut self, tokens: f64) -> Self {
        self.config.initial = self.milli("initial", tokens, false);
        self.initial_set = true;
        self
    }

    /// What a retry costs after a failure that is neither a timeout nor a 429. Must be above
    /// zero: a free retry is no budget at all (use `without_budget()` for that).
    pub fn retry_cost(mut self, tokens: f64) -> Self {
        self.config.retry_cost = self.milli("retry_cost", tokens, true);
        self
    }

    /// What a retry costs after a timeout. Must be above zero.
    pub fn timeout_cost(mut self, tokens: f64) -> Self {
        self.config.timeout_cost = self.milli("timeout_cost", tokens, true);
        self
    }

    /// What a retry costs after a `429 Too Many Requests`. Must be above zero.
    pub fn throttled_cost(mut self, tokens: f64) -> Self {
        self.config.throttled_cost = self.milli("throttled_cost", tokens, true);
        self
    }

    /// The tokens a first attempt that goes well deposits, as a fraction of
    /// [`retry_cost`](Self::retry_cost) (whatever order the two are set in): retries then add
    /// at most about this fraction of the load that succeeds. Must be above 0 and at most 1000,
    /// and the deposit it gives at least 0.001 tokens.
    pub fn deposit_ratio(mut self, ratio: f64) -> Self {
        if !(ratio.is_finite() && ratio > 0.0 && ratio <= 1000.0) {
            self.invalid.get_or_insert_with(|| {
                format!("deposit ratio must be above 0 and at most 1000, not {ratio}")
            });
            return self;
        }
        self.deposit_ratio = ratio;
        self
    }

    /// Whether a success after retries refunds what its last retry cost.
    pub fn refund_on_success(mut self, refund: bool) -> Self {
        self.config.refund = refund;
        self
    }

    /// Tokens earned per second whatever happens, so a quiet client can still retry; 0 turns the
    /// floor off. During a total outage this is the extra load, in retries per second, the
    /// budget lets through once the bucket is empty.
    pub fn floor_per_sec(mut self, tokens: f64) -> Self {
        self.config.floor_per_sec = self.milli("floor_per_sec", tokens, false);
        self
    }

    /// Validates the settings and builds the budget.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when an amount is negative, not finite or over 1e12 tokens, a cost or
    /// the capacity is zero, the capacity is below a retry's cost, the initial balance is above
    /// the capacity, or the deposit ratio gives a deposit below the budget's resolution (0.001
    /// tokens).
    pub fn build(mut self) -> Result<RetryBudget, InvalidConfig> {
        if let Some(message) = self.invalid {
            return Err(InvalidConfig::new(BUDGET, message));
        }
        let c = &mut self.config;
        if !self.initial_set {
            c.initial = c.capacity;
        }
        let deposit = (c.retry_cost as f64 * self.deposit_ratio).round();
        if deposit < 1.0 {
            return Err(InvalidConfig::new(
                BUDGET,
                format!(
                    "deposit ratio {} of a retry cost of {} tokens deposits less than 0.001 \
                     tokens, the budget's resolution: raise the ratio or the retry cost",
                    self.deposit_ratio,
                    c.retry_cost as f64 / MILLI as f64
                ),
            ));
        }
        c.deposit = deposit as u64;
        let dearest = c.retry_cost.max(c.timeout_cost).max(c.throttled_cost);
        if c.capacity < dearest {
            return Err(InvalidConfig::new(
                BUDGET,
                format!(
                    "capacity ({} tokens) must hold at least one retry ({} tokens): raise capacity",
                    c.capacity as f64 / MILLI as f64,
                    dearest as f64 / MILLI as f64
                ),
            ));
        }
        if c.initial > c.capacity {
            return Err(InvalidConfig::new(
                BUDGET,
                format!(
                    "initial ({} tokens) must not exceed the capacity ({} tokens)",
                    c.initial as f64 / MILLI as f64,
                    c.capacity as f64 / MILLI as f64
                ),
            ));
        }
        Ok(RetryBudget::from_config(self.config))
    }
}

/// The balance: one atomic, updated by compare-and-swap loops.
#[derive(Debug)]
pub(crate) struct Tokens(AtomicU64);

impl Tokens {
    pub(crate) fn new(initial: u64) -> Self {
        Tokens(AtomicU64::new(initial))
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Takes `cost` if the balance covers it.
    pub(crate) fn withdraw(&self, cost: u64) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |balance| {
                balance.checked_sub(cost)
            })
            .is_ok()
    }

    /// Adds `amount`, up to `capacity`.
    pub(crate) fn deposit(&self, amount: u64, capacity: u64) {
        // The closure always returns `Some`, so the update cannot fail.
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |balance| {
                Some(balance.saturating_add(amount).min(capacity).max(balance))
            });
    }
}

impl crate::observe::Balance for RetryBudget {
    fn balance(&self) -> f64 {
        RetryBudget::balance(self)
    }
}

#[cfg(all(test, not(reqwest_safe_retry_loom)))]
mod tests {
    use super::*;
    use std::time::Duration;

    fn no_floor() -> RetryBudgetBuilder {
        RetryBudget::builder().floor_per_sec(0.0)
    }

    #[test]
    fn the_default_is_a_full_ten_token_ratio_budget() {
        let budget = RetryBudget::default();
        assert_eq!(budget.balance(), 10.0);
        assert_eq!(budget.capacity(), 10.0);
        assert_eq!(budget.inner.config.deposit, 100);
        assert_eq!(budget.inner.config.retry_cost, 1000);
        assert_eq!(budget.inner.config.floor_per_sec, 1000);
        assert_eq!(
            budget.inner.config,
            RetryBudget::ratio(0.1).unwrap().inner.config
        );
    }

    #[test]
    fn retries_are_refused_once_the_bucket_is_empty() {
        let budget = no_floor().capacity(3.0).build().unwrap();
        let now = Instant::now();
        for _ in 0..3 {
            assert_eq!(budget.try_withdraw(RetryKind::Other, now), Some(1000));
        }
        assert_eq!(budget.try_withdraw(RetryKind::Other, now), None);
        assert_eq!((budget.retries(), budget.refusals()), (3, 1));
        assert_eq!(budget.balance_milli(), 0);
    }

    #[test]
    fn ten_successes_at_a_ratio_of_a_tenth_pay_for_one_retry() {
        let budget = no_floor().initial(0.0).build().unwrap();
        let now = Instant::now();
        for _ in 0..9 {
            budget.deposit_first_attempt();
        }
        assert_eq!(budget.try_withdraw(RetryKind::Other, now), None);
        budget.deposit_first_attempt();
        assert_eq!(budget.try_withdraw(RetryKind::Other, now), Some(1000));
    }

    #[test]
    fn deposits_stop_at_the_capacity() {
        let budget = RetryBudget::default();
        let now = Instant::now();
        assert!(budget.try_withdraw(RetryKind::Other, now).is_some());
        for _ in 0..1000 {
            budget.deposit_first_attempt();
        }
        assert_eq!(budget.balance(), 10.0);
    }

    #[test]
    fn the_floor_earns_tokens_with_time_and_carries_fractions() {
        let budget = RetryBudget::builder()
            .floor_per_sec(2.0)
            .initial(0.0)
            .build()
            .unwrap();
        let t0 = Instant::now();
        assert_eq!(budget.try_withdraw(RetryKind::Other, t0), None);
        // 0.25 s earns half a token: not enough; 0.5 s earns one.
        assert_eq!(
            budget.try_withdraw(RetryKind::Other, t0 + Duration::from_millis(250)),
            None
        );
        assert_eq!(
            budget.try_withdraw(RetryKind::Other, t0 + Duration::from_millis(500)),
            Some(1000)
        );
        // A hundred seconds earn at most the capacity.
        budget.inner.refill(t0 + Duration::from_secs(100));
        assert_eq!(budget.balance(), 10.0);
    }

    #[test]
    fn the_floor_counts_from_its_last_mark_and_carries_the_fraction_exactly() {
        // 0.007 tokens (7 milli-tokens) a second: 1.1 s earn 7, the 0.1 s left carries over.
        let budget = RetryBudget::builder()
            .floor_per_sec(0.007)
            .initial(0.0)
            .build()
            .unwrap();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        budget.inner.refill(t0);
        assert_eq!(budget.balance_milli(), 0, "the first reading is the origin");
        budget.inner.refill(at(1_100));
        assert_eq!(budget.balance_milli(), 7);
        // 1.0 s since the mark (0.1 s carried + 0.9 s): 7 more, not 14.
        budget.inner.refill(at(2_000));
        assert_eq!(budget.balance_milli(), 14);
        // 1.9 s since the mark: 13.3, so 13.
        budget.inner.refill(at(3_900));
        assert_eq!(budget.balance_milli(), 27);
        // An earlier reading earns nothing and moves nothing.
        budget.inner.refill(at(1_000));
        assert_eq!(budget.balance_milli(), 27);
    }

    #[test]
    fn its_debug_shows_the_balance_and_the_counts() {
        let budget = no_floor().capacity(4.0).build().unwrap();
        assert!(
            budget
                .try_withdraw(RetryKind::Other, Instant::now())
                .is_some()
        );
        assert_eq!(
            format!("{budget:?}"),
            "RetryBudget { balance: 3.0, capacity: 4.0, retries: 1, refusals: 0 }"
        );
    }

    #[test]
    fn aws_like_costs_depend_on_the_failure_and_success_refunds() {
        let budget = RetryBudget::aws_like();
        let now = Instant::now();
        assert_eq!(budget.try_withdraw(RetryKind::Other, now), Some(5000));
        assert_eq!(budget.try_withdraw(RetryKind::Timeout, now), Some(10_000));
        assert_eq!(budget.try_withdraw(RetryKind::Throttled, now), Some(1000));
        assert_eq!(budget.balance_milli(), 484_000);
        budget.refund(5000);
        assert_eq!(budget.balance_milli(), 489_000);
        budget.deposit_first_attempt();
        assert_eq!(budget.balance_milli(), 490_000);
    }

    #[test]
    fn clones_share_one_bucket() {
        let a = no_floor().capacity(1.0).build().unwrap();
        let b = a.clone();
        assert!(a.same_bucket(&b));
        assert!(b.try_withdraw(RetryKind::Other, Instant::now()).is_some());
        assert!(a.try_withdraw(RetryKind::Other, Instant::now()).is_none());
        assert!(!a.same_bucket(&RetryBudget::default()));
    }

    #[test]
    fn invalid_settings_say_what_to_change() {
        let cases: Vec<(RetryBudgetBuilder, &str)> = vec![
            (
                RetryBudget::builder().capacity(0.5),
                "capacity (0.5 tokens) must hold at least one retry (1 tokens): raise capacity",
            ),
            (
                RetryBudget::builder().capacity(0.0),
                "capacity must be a number of tokens from 0.001 to 1e12, not 0",
            ),
            (
                RetryBudget::builder().capacity(2.0).initial(3.0),
                "initial (3 tokens) must not exceed the capacity (2 tokens)",
            ),
            (
                RetryBudget::builder().retry_cost(f64::NAN),
                "retry_cost must be a number of tokens from 0.001 to 1e12, not NaN",
            ),
            (
                RetryBudget::builder().retry_cost(0.0),
                "retry_cost must be a number of tokens from 0.001 to 1e12, not 0",
            ),
            (
                RetryBudget::builder().retry_cost(-1.0),
                "retry_cost must be a number of tokens from 0.001 to 1e12, not -1",
            ),
            (
                RetryBudget::builder().timeout_cost(0.0),
                "timeout_cost must be a number of tokens from 0.001 to 1e12, not 0",
            ),
            (
                RetryBudget::builder().throttled_cost(1e13),
                "throttled_cost must be a number of tokens from 0.001 to 1e12, not 10000000000000",
            ),
            (
                RetryBudget::builder().initial(-0.5),
                "initial must be a number of tokens from 0 to 1e12, not -0.5",
            ),
            (
                RetryBudget::builder().floor_per_sec(f64::INFINITY),
                "floor_per_sec must be a number of tokens from 0 to 1e12, not inf",
            ),
            (
                RetryBudget::builder().deposit_ratio(0.0),
                "deposit ratio must be above 0 and at most 1000, not 0",
            ),
            (
                RetryBudget::builder().deposit_ratio(1e-9),
                "deposit ratio 0.000000001 of a retry cost of 1 tokens deposits less than 0.001 \
                 tokens, the budget's resolution: raise the ratio or the retry cost",
            ),
        ];
        for (builder, message) in cases {
            assert_eq!(
                builder.build().unwrap_err().to_string(),
                format!("invalid retry budget: {message}")
            );
        }
        assert!(RetryBudget::ratio(1e-9).is_err());
    }

    #[test]
    fn amounts_at_the_ends_of_their_ranges_are_accepted() {
        let smallest = RetryBudget::builder()
            .capacity(0.001)
            .retry_cost(0.001)
            .timeout_cost(0.001)
            .throttled_cost(0.001)
            .deposit_ratio(1.0)
            .initial(0.0)
            .floor_per_sec(0.0)
            .build()
            .unwrap();
        assert_eq!(smallest.inner.config.retry_cost, 1);
        assert_eq!(smallest.inner.config.deposit, 1);
        let largest = RetryBudget::builder()
            .capacity(1e12)
            .retry_cost(1e12)
            .floor_per_sec(1e12)
            .build()
            .unwrap();
        assert_eq!(largest.balance_milli(), 1_000_000_000_000_000);
    }

    #[test]
    fn the_deposit_ratio_applies_to_the_retry_cost_whatever_the_order() {
        let a = RetryBudget::builder()
            .deposit_ratio(0.1)
            .retry_cost(5.0)
            .capacity(10.0)
            .build()
            .unwrap();
        let b = RetryBudget::builder()
            .capacity(10.0)
            .retry_cost(5.0)
            .deposit_ratio(0.1)
            .build()
            .unwrap();
        assert_eq!(a.inner.config.deposit, 500);
        assert_eq!(a.inner.config, b.inner.config);
    }

    #[test]
    fn a_ratio_budget_deposits_its_ratio() {
        for (ratio, deposit) in [(0.1, 100), (0.25, 250), (1.0, 1000), (0.001, 1)] {
            let budget = RetryBudget::ratio(ratio).unwrap();
            assert_eq!(budget.inner.config.deposit, deposit, "{ratio}");
        }
    }

    #[test]
    fn exact_accounting_under_real_threads() {
        // Large enough that nothing is refused or clamped: the model is plain arithmetic.
        const THREADS: u64 = 8;
        const ROUNDS: u64 = 20_000;
        let initial = 1_000_000 * MILLI;
        let tokens = Arc::new(Tokens::new(initial));
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let tokens = tokens.clone();
                s.spawn(move || {
                    for i in 0..ROUNDS {
                        // Each thread: 3 withdrawals of 7 for every deposit of 13, interleaved.
                        if (i + t) % 4 == 0 {
                            tokens.deposit(13, u64::MAX);
                        } else {
                            assert!(tokens.withdraw(7));
                        }
                    }
                });
            }
        });
        let deposits: u64 = (0..THREADS)
            .map(|t| (0..ROUNDS).filter(|i| (i + t) % 4 == 0).count() as u64)
            .sum();
        let withdrawals = THREADS * ROUNDS - deposits;
        assert_eq!(tokens.get(), initial + deposits * 13 - withdrawals * 7);
    }

    #[test]
    fn contended_withdrawals_never_overdraw() {
        let tokens = Arc::new(Tokens::new(1000 * 7));
        let granted = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if tokens.withdraw(7) {
                            granted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(granted.load(Ordering::Relaxed), 1000);
        assert_eq!(tokens.get(), 0);
    }
}

#[cfg(all(test, reqwest_safe_retry_loom))]
mod loom_tests {
    use super::Tokens;
    use loom::sync::Arc;
    use loom::thread;

    /// Every interleaving of two withdrawals and a deposit ends with the balance the model
    /// predicts, and never pays out more than there is.
    #[test]
    fn concurrent_updates_are_exact_in_every_interleaving() {
        loom::model(|| {
            let tokens = Arc::new(Tokens::new(10));
            let a = {
                let tokens = tokens.clone();
                thread::spawn(move || tokens.withdraw(7))
            };
            let b = {
                let tokens = tokens.clone();
                thread::spawn(move || tokens.withdraw(7))
            };
            tokens.deposit(5, 12);
            let (a, b) = (a.join().unwrap(), b.join().unwrap());
            let paid = 7 * (u64::from(a) + u64::from(b));
            let balance = tokens.get();
            // The only outcomes a correct bucket allows:
            // deposit first (10 + 5, capped at 12), then one withdrawal: paid 7, 5 left;
            // a withdrawal, the deposit, the other withdrawal: paid 14, 1 left;
            // both withdrawals (the second refused), then the deposit: paid 7, 8 left.
            assert!(
                [(7, 5), (14, 1), (7, 8)].contains(&(paid, balance)),
                "paid {paid}, left {balance}"
            );
        });
    }
}
