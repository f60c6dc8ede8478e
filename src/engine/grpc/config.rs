//! A6's retry policy and the parts of a gRPC service config that carry it: which methods are
//! retried and how, the channel's throttling, and (beyond A6) which methods carry an
//! idempotency key. Built in code or read from a service config's JSON, to the same values.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::engine::budget::RetryBudget;
use crate::engine::dependency::{Dependency, RetryOverride, Routes};
use crate::engine::grpc::hedging::GrpcHedgingPolicy;
use crate::engine::grpc::rules::GrpcRules;
use crate::engine::grpc::throttle::RetryThrottling;
use crate::engine::grpc::{
    CodeSet, GRPC_MAX_ATTEMPTS, PathTable, bad_in, code_named, in_range, max_attempts, status_codes,
};
use crate::engine::policy::RetryPolicy;
use crate::error::InvalidConfig;

/// The area named in this module's configuration errors.
const AREA: &str = "gRPC retry policy";
/// The area of a service config's errors.
const CONFIG: &str = "gRPC service config";

/// A6's retry policy for a method or a service (feature `grpc`): how many attempts, the backoff
/// between them, and which status codes are retried.
///
/// The wait before retry `n` (from 1) is `min(initial_backoff * backoff_multiplier^(n-1),
/// max_backoff)`, moved at random by up to 20 % either way (A6 as revised in 2024; so a wait
/// may pass `max_backoff` by a fifth). A server's `grpc-retry-pushback-ms` replaces it (exactly,
/// without jitter), and the backoff starts again from `initial_backoff` after it.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::grpc::GrpcRetryPolicy;
///
/// let policy = GrpcRetryPolicy::builder()
///     .max_attempts(4)
///     .initial_backoff(Duration::from_millis(100))
///     .max_backoff(Duration::from_secs(1))
///     .backoff_multiplier(2.0)
///     .retryable_codes([14]) // UNAVAILABLE; with tonic, its `Code::Unavailable`
///     .build()?;
/// assert_eq!(policy.max_attempts(), 4);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcRetryPolicy {
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    /// In thousandths.
    multiplier_milli: u32,
    codes: CodeSet,
}

impl GrpcRetryPolicy {
    /// A builder: every field must be set but the multiplier's default, 2.
    pub fn builder() -> GrpcRetryPolicyBuilder {
        GrpcRetryPolicyBuilder::default()
    }

    /// The most attempts, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The wait's ceiling before the first retry.
    pub fn initial_backoff(&self) -> Duration {
        self.initial_backoff
    }

    /// The ceiling's most.
    pub fn max_backoff(&self) -> Duration {
        self.max_backoff
    }

    /// What the ceiling is multiplied by after each retry.
    pub fn backoff_multiplier(&self) -> f64 {
        f64::from(self.multiplier_milli) / 1000.0
    }

    /// Whether a call that ends with `code` (a number, as tonic's `Code as i32`) is retried.
    pub fn retries_code(&self, code: i32) -> bool {
        u8::try_from(code).is_ok_and(|c| self.codes.has(c))
    }

    /// The codes it retries.
    pub(crate) fn codes(&self) -> CodeSet {
        self.codes
    }

    /// The crate's policy that carries it out: A6's attempts and backoff, answers judged by
    /// their gRPC status, the wait the server pushes back with taken exactly, and the call's
    /// deadline (`grpc-timeout`, when it has one) over every attempt, with no attempt timeout
    /// of its own.
    pub(crate) fn to_policy(self) -> (RetryPolicy, GrpcRules) {
        GrpcRules::retrying(
            self.max_attempts,
            (
                self.initial_backoff,
                self.max_backoff,
                self.multiplier_milli,
            ),
            self.codes,
        )
    }
}

/// Builds a [`GrpcRetryPolicy`], checking A6's rules.
#[derive(Debug, Clone, Default)]
pub struct GrpcRetryPolicyBuilder {
    max_attempts: Option<u32>,
    most: Option<u32>,
    initial_backoff: Option<Duration>,
    max_backoff: Option<Duration>,
    multiplier: Option<f64>,
    codes: Vec<i32>,
}

impl GrpcRetryPolicyBuilder {
    /// The most attempts, the first included: at least 2. Above 5 it is cut to 5, as A6 says,
    /// unless [`allow_attempts_above_five`](Self::allow_attempts_above_five) raised the cap.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Raises A6's cap of 5 attempts to `most`, on purpose.
    pub fn allow_attempts_above_five(mut self, most: u32) -> Self {
        self.most = Some(most);
        self
    }

    /// The wait's ceiling before the first retry: above zero.
    pub fn initial_backoff(mut self, backoff: Duration) -> Self {
        self.initial_backoff = Some(backoff);
        self
    }

    /// The ceiling's most: above zero, and not below `initial_backoff`.
    pub fn max_backoff(mut self, backoff: Duration) -> Self {
        self.max_backoff = Some(backoff);
        self
    }

    /// What the ceiling is multiplied by after each retry: above zero (2 unless set), read to
    /// three decimal places.
    pub fn backoff_multiplier(mut self, multiplier: f64) -> Self {
        self.multiplier = Some(multiplier);
        self
    }

    /// The status codes retried (at least one): tonic's `Code`s, or their numbers.
    pub fn retryable_codes<C: Into<i32>>(mut self, codes: impl IntoIterator<Item = C>) -> Self {
        self.codes.extend(codes.into_iter().map(Into::into));
        self
    }

    /// The policy.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] naming the field (as a service config names it) that breaks A6's
    /// rules: no `maxAttempts` or one below 2, no `initialBackoff` or `maxBackoff` or one that
    /// is zero or longer than a gRPC duration holds (about 292 years), a `backoffMultiplier`
    /// not above zero, no `retryableStatusCodes` or one that is not a code (0 to 16). A
    /// `maxBackoff` below `initialBackoff` is taken, as grpc-go takes it: every wait is then
    /// capped at `maxBackoff`.
    pub fn build(self) -> Result<GrpcRetryPolicy, InvalidConfig> {
        let bad = |msg: String| Err(InvalidConfig::new(AREA, msg));
        let attempts = max_attempts(self.max_attempts, self.most, "retry").map_err(bad_in(AREA))?;
        let (Some(initial), Some(max)) = (self.initial_backoff, self.max_backoff) else {
            return bad("initialBackoff and maxBackoff are required: set both".into());
        };
        if initial.is_zero() || max.is_zero() {
            return bad(format!(
                "initialBackoff ({initial:?}) and maxBackoff ({max:?}) must be above zero"
            ));
        }
        in_range(initial, "initialBackoff").map_err(bad_in(AREA))?;
        in_range(max, "maxBackoff").map_err(bad_in(AREA))?;
        let multiplier = self.multiplier.unwrap_or(2.0);
        let milli = (multiplier * 1000.0).round();
        if !(milli >= 1.0 && milli <= f64::from(u32::MAX)) {
            return bad(format!(
                "backoffMultiplier ({multiplier}) must be above zero (at least 0.001)"
            ));
        }
        let codes = status_codes(self.codes, "retryableStatusCodes").map_err(bad_in(AREA))?;
        Ok(GrpcRetryPolicy {
            max_attempts: attempts,
            initial_backoff: initial,
            max_backoff: max,
            multiplier_milli: milli as u32,
            codes,
        })
    }
}

/// The methods a method config names: a service's (`"pkg.Service"`), one method
/// (`"pkg.Service/Method"`), or every one (`""`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Name {
    pub(crate) service: String,
    pub(crate) method: Option<String>,
}

impl Name {
    fn parse(name: &str) -> Result<Name, InvalidConfig> {
        let (service, method) = match name.split_once('/') {
            Some((service, method)) => (service, Some(method)),
            None => (name, None),
        };
        if method.is_some_and(|m| m.is_empty() || m.contains('/'))
            || (service.is_empty() && method.is_some())
        {
            return Err(InvalidConfig::new(
                CONFIG,
                format!(
                    "{name:?} is not a name: write \"pkg.Service\", \"pkg.Service/Method\", or \"\" for every method"
                ),
            ));
        }
        Ok(Name {
            service: service.to_owned(),
            method: method.map(str::to_owned),
        })
    }

    /// Every method's name (`""`).
    fn every() -> Name {
        Name {
            service: String::new(),
            method: None,
        }
    }

    /// The names that cover its calls, closest first: itself, its service's, every method's.
    fn and_wider(&self) -> impl Iterator<Item = Name> + '_ {
        let service = (self.method.is_some()).then(|| Name {
            service: self.service.clone(),
            method: None,
        });
        let every = (!self.service.is_empty()).then(Name::every);
        std::iter::once(self.clone()).chain(service).chain(every)
    }

    /// The name of the calls to `path` (`/pkg.Service/Method`), if it is one.
    #[cfg(test)]
    fn of_path(path: &str) -> Option<Name> {
        let (service, method) = path.strip_prefix('/')?.split_once('/')?;
        Some(Name {
            service: service.to_owned(),
            method: Some(method.to_owned()),
        })
    }
}

impl std::fmt::Display for Name {
    /// As it was given: `pkg.Service/Method`, `pkg.Service`, or `*` for every method.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.method, self.service.as_str()) {
            (Some(m), service) => write!(f, "{service}/{m}"),
            (None, "") => f.write_str("*"),
            (None, service) => f.write_str(service),
        }
    }
}

/// The name of the dependency that serves the calls `name` names: `grpc ` and the name, `*`
/// for every method (and the default, for the calls no name covers).
pub(crate) fn dependency_name(name: &str) -> String {
    let shown = if name.is_empty() { "*" } else { name };
    format!("grpc {shown}")
}

/// What a method's calls run under: a retry policy or a hedging policy (A6: one, not both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MethodPolicy {
    Retry(GrpcRetryPolicy),
    Hedge(GrpcHedgingPolicy),
}

impl MethodPolicy {
    /// The codes that leave the call running: retried, or non-fatal.
    pub(crate) fn codes(self) -> CodeSet {
        match self {
            MethodPolicy::Retry(policy) => policy.codes(),
            MethodPolicy::Hedge(policy) => policy.codes(),
        }
    }

    /// The most attempts: retries, or copies.
    pub(crate) fn max_attempts(self) -> u32 {
        match self {
            MethodPolicy::Retry(policy) => policy.max_attempts(),
            MethodPolicy::Hedge(policy) => policy.max_attempts(),
        }
    }

    fn to_policy(self) -> (RetryPolicy, GrpcRules) {
        match self {
            MethodPolicy::Retry(policy) => policy.to_policy(),
            MethodPolicy::Hedge(policy) => policy.to_policy(),
        }
    }
}

/// What a service config says of some methods: their method config, which stands for them
/// whole (a closer name's config without a policy or a timeout leaves its calls none, as
/// grpc-go reads a service config).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MethodConfig {
    pub(crate) name: Name,
    pub(crate) policy: Option<MethodPolicy>,
    /// The method-level `timeout`: the calls' deadline when they carry none or a later one.
    pub(crate) timeout: Option<Duration>,
}

/// What the calls one name names run under: the closest method config's policy and timeout,
/// and whether a name that covers them is marked non-idempotent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Resolved {
    pub(crate) policy: Option<MethodPolicy>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) keyed: bool,
}

/// What each call through a layer runs under, found by its path in time independent of the
/// number of method configs: what the layer reads per call (the method-level timeout, the
/// codes its trailers are counted by, A6's cap on an override's attempts).
#[derive(Debug, Clone, Default)]
pub(crate) struct Calls {
    by_path: PathTable<Resolved>,
    every: Resolved,
    /// Whether any method config sets a timeout (if none does, no call looks one up).
    pub(crate) timeouts: bool,
}

impl Calls {
    /// What the call to `path` runs under.
    pub(crate) fn of(&self, path: &str) -> &Resolved {
        self.by_path.get(path).unwrap_or(&self.every)
    }

    /// The deadline of the call to `path` that carries `told` (its `grpc-timeout`, if any):
    /// the earlier of it and its method's timeout, as grpc-go takes them. The method's is
    /// looked up only when a method config sets one (most set none).
    pub(crate) fn deadline(&self, path: &str, told: Option<Duration>) -> Option<Duration> {
        let method = self.timeouts.then(|| self.of(path).timeout).flatten();
        match (method, told) {
            (Some(method), Some(told)) => Some(method.min(told)),
            (method, told) => method.or(told),
        }
    }

    /// The most attempts an override may ask of the call to `path`: A6's cap, or the one its
    /// method's policy raised on purpose.
    pub(crate) fn most_attempts(&self, path: &str) -> u32 {
        (self.of(path).policy)
            .map_or(GRPC_MAX_ATTEMPTS, MethodPolicy::max_attempts)
            .max(GRPC_MAX_ATTEMPTS)
    }

    /// The override the call to `path` runs under, from the one it `asked` for: its deadline
    /// the call's own (`timeout`: its `grpc-timeout` or its method's), which the override can
    /// shorten and never drops, and at most [`most_attempts`](Self::most_attempts), which the
    /// override cannot pass. Those are looked up only for an override that sets attempts: most
    /// calls carry a deadline alone.
    pub(crate) fn overriding(
        &self,
        path: &str,
        timeout: Option<Duration>,
        asked: RetryOverride,
    ) -> RetryOverride {
        let mut over = asked;
        let deadline = match (asked.deadline_set(), timeout) {
            (Some(asked), Some(call)) => Some(asked.min(call)),
            (asked, call) => asked.or(call),
        };
        if let Some(deadline) = deadline {
            over = over.deadline(deadline);
        }
        if let Some(attempts) = asked.attempts_set() {
            over = over.max_attempts(attempts.min(self.most_attempts(path)));
        }
        over
    }
}

/// What a gRPC retry layer does for each method (feature `grpc`): A6's retry policy or hedging
/// policy per service or method, the channel's [`RetryThrottling`], which methods carry an idempotency
/// key, and how much of a call is held for a retry. Built in code, or read from a service
/// config's JSON ([`from_json`](Self::from_json)) to the same values.
///
/// A method with no policy is not retried or hedged. Names: `"pkg.Service/Method"` for one method,
/// `"pkg.Service"` for a service's, `""` for every one; the closest name's method config (its
/// policy and its [`timeout`](Self::timeout)) decides, whole, as in a service config.
/// [`non_idempotent`](Self::non_idempotent) marks names apart: it leaves their policy as it is.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::grpc::{GrpcConfig, GrpcRetryPolicy, RetryThrottling};
///
/// let unavailable = GrpcRetryPolicy::builder()
///     .max_attempts(3)
///     .initial_backoff(Duration::from_millis(100))
///     .max_backoff(Duration::from_secs(1))
///     .retryable_codes([14])
///     .build()?;
/// let built = GrpcConfig::new()
///     .retry("payments.Ledger", unavailable)?
///     .non_idempotent("payments.Ledger/Charge")?
///     .retry_throttling(RetryThrottling::new(10.0, 0.1)?);
///
/// let read = GrpcConfig::from_json(r#"{
///   "methodConfig": [{
///     "name": [{"service": "payments.Ledger"}],
///     "retryPolicy": {
///       "maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
///       "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]
///     }
///   }],
///   "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
/// }"#)?
/// .non_idempotent("payments.Ledger/Charge")?;
/// assert_eq!(built, read);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
#[derive(Debug, Clone)]
pub struct GrpcConfig {
    pub(crate) methods: Vec<MethodConfig>,
    /// Where each name's method config is in `methods`.
    index: HashMap<Name, usize>,
    /// The names marked non-idempotent.
    keyed: BTreeSet<Name>,
    pub(crate) throttling: Option<RetryThrottling>,
    /// The budget retries are paid from without throttling; `None`: one of the layer's own.
    pub(crate) budget: Option<RetryBudget>,
    pub(crate) per_call_buffer: usize,
    pub(crate) per_channel_buffer: usize,
}

impl PartialEq for GrpcConfig {
    /// The same methods, limits and throttling parameters (not the same count, nor the same
    /// budget).
    fn eq(&self, other: &Self) -> bool {
        let params =
            |t: &Option<RetryThrottling>| t.as_ref().map(|t| (t.max_tokens(), t.token_ratio()));
        self.methods == other.methods
            && self.keyed == other.keyed
            && params(&self.throttling) == params(&other.throttling)
            && self.per_call_buffer == other.per_call_buffer
            && self.per_channel_buffer == other.per_channel_buffer
    }
}

impl Default for GrpcConfig {
    fn default() -> Self {
        GrpcConfig::new()
    }
}

impl GrpcConfig {
    /// No method retried, no throttling, the buffer limits' defaults (1 MiB per call, 16 MiB
    /// per channel, as grpc-java's).
    pub fn new() -> Self {
        GrpcConfig {
            methods: Vec::new(),
            index: HashMap::new(),
            keyed: BTreeSet::new(),
            throttling: None,
            budget: None,
            per_call_buffer: 1 << 20,
            per_channel_buffer: 16 << 20,
        }
    }

    /// Retries the calls `name` names under `policy`.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when `name` is not a name, or a policy was already given for it.
    pub fn retry(self, name: &str, policy: GrpcRetryPolicy) -> Result<Self, InvalidConfig> {
        self.with_policy(name, MethodPolicy::Retry(policy))
    }

    /// Hedges the calls `name` names under `policy`: several copies of each call in flight,
    /// the first answer taken (A6's hedging policy). Only for methods safe to run more than
    /// once.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when `name` is not a name, or a policy (retry or hedging) was already
    /// given for it.
    pub fn hedge(self, name: &str, policy: GrpcHedgingPolicy) -> Result<Self, InvalidConfig> {
        self.with_policy(name, MethodPolicy::Hedge(policy))
    }

    /// `policy` for the calls `name` names, unless they have one.
    fn with_policy(mut self, name: &str, policy: MethodPolicy) -> Result<Self, InvalidConfig> {
        let name = Name::parse(name)?;
        let at = self.entry(name);
        if self.methods[at].policy.is_some() {
            return Err(InvalidConfig::new(
                CONFIG,
                format!(
                    "{} is named twice: a method has one policy, retry or hedging",
                    self.methods[at].name
                ),
            ));
        }
        self.methods[at].policy = Some(policy);
        Ok(self)
    }

    /// Beyond A6: the calls `name` names are not idempotent, so each carries an idempotency key
    /// in its metadata (`idempotency-key`), one per call, the same on every attempt: against a
    /// server that dedupes on it, a retry cannot repeat the call's effect.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when `name` is not a name.
    pub fn non_idempotent(mut self, name: &str) -> Result<Self, InvalidConfig> {
        self.keyed.insert(Name::parse(name)?);
        Ok(self)
    }

    /// The method-level `timeout` of the calls `name` names, as a service config's
    /// `methodConfig[].timeout` sets it: a call's deadline when it carries none, or a later
    /// one (the earlier of the two wins, and the server is told it in `grpc-timeout`). The
    /// closest name's method config decides, whole, as in a service config: a method with a
    /// config of its own that sets no timeout has none, whatever its service's says.
    ///
    /// ```
    /// use std::time::Duration;
    /// use reqwest_safe_retry::grpc::GrpcConfig;
    ///
    /// let config = GrpcConfig::new().timeout("payments.Ledger", Duration::from_secs(2))?;
    /// # drop(config);
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when `name` is not a name, a timeout was already given for it, or
    /// `timeout` is zero (every call would fail) or longer than a gRPC duration holds (about
    /// 292 years).
    pub fn timeout(mut self, name: &str, timeout: Duration) -> Result<Self, InvalidConfig> {
        let name = Name::parse(name)?;
        let timeout = method_timeout(timeout)
            .map_err(|e| InvalidConfig::new(CONFIG, format!("the timeout of {name} {e}")))?;
        let at = self.entry(name);
        let entry = &mut self.methods[at];
        if entry.timeout.is_some() {
            return Err(InvalidConfig::new(
                CONFIG,
                format!("{} is given a timeout twice", entry.name),
            ));
        }
        entry.timeout = Some(timeout);
        Ok(self)
    }

    /// The channel's throttling, shared by every method: each channel a layer of this config is
    /// put around counts its own tokens, as A6 counts per server.
    pub fn retry_throttling(mut self, throttling: RetryThrottling) -> Self {
        self.throttling = Some(throttling);
        self
    }

    /// Pays the retries and hedges of every method from `budget` when the channel has no
    /// [`retry_throttling`](Self::retry_throttling) (with it, the throttling alone decides, as
    /// A6 says). By default the layer has a [`RetryBudget`] of its own (10 tokens, 10 % of the
    /// first attempts that go well). A clone of a budget shares its tokens: give the same one
    /// to [`Dependency::with_budget`] to make a gRPC layer and an HTTP client of the same
    /// service draw on one account, on purpose.
    ///
    /// ```
    /// use reqwest_safe_retry::{Dependency, RetryBudget, RetryPolicy, grpc::GrpcConfig};
    ///
    /// let shared = RetryBudget::default();
    /// let grpc = GrpcConfig::new().retry_budget(shared.clone());
    /// let http = Dependency::new("payments", RetryPolicy::default()).with_budget(shared);
    /// # drop((grpc, http));
    /// ```
    pub fn retry_budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// How much of a call's request is held for a retry: `per_call` bytes of one call, and
    /// `per_channel` of all the calls in flight through one layer. A call past either is sent
    /// once, as committed.
    pub fn buffer_limits(mut self, per_call: usize, per_channel: usize) -> Self {
        self.per_call_buffer = per_call;
        self.per_channel_buffer = per_channel;
        self
    }

    /// The method config that `name` names, made if there is none.
    fn entry(&mut self, name: Name) -> usize {
        if let Some(&at) = self.index.get(&name) {
            return at;
        }
        self.index.insert(name.clone(), self.methods.len());
        self.methods.push(MethodConfig {
            name,
            policy: None,
            timeout: None,
        });
        self.methods.len() - 1
    }

    /// The policy of the call to `path`: the closest method config's (a layer reads its
    /// [`Calls`] instead, built once).
    #[cfg(test)]
    pub(crate) fn for_path(&self, path: &str) -> Option<MethodPolicy> {
        self.resolve(&Name::of_path(path)?).policy
    }

    /// What the calls `name` names run under: the closest method config's policy and
    /// timeout (found by name, at most three look-ups), and whether a name that covers them
    /// is marked non-idempotent.
    pub(crate) fn resolve(&self, name: &Name) -> Resolved {
        let mut resolved = Resolved::default();
        let mut decided = false;
        for wider in name.and_wider() {
            if !decided {
                if let Some(&at) = self.index.get(&wider) {
                    let config = &self.methods[at];
                    resolved.policy = config.policy;
                    resolved.timeout = config.timeout;
                    decided = true;
                }
            }
            resolved.keyed |= self.keyed.contains(&wider);
        }
        resolved
    }

    /// The names calls are routed by: every method config's, and every one marked
    /// non-idempotent (all but `""`, every method's, which is the default's).
    fn route_names(&self) -> BTreeSet<&Name> {
        let configs = self.methods.iter().map(|m| &m.name);
        configs
            .chain(self.keyed.iter())
            .filter(|name| !name.service.is_empty())
            .collect()
    }

    /// What each call through a layer of this config runs under, by its path.
    pub(crate) fn calls(&self) -> Calls {
        let mut by_path = PathTable::default();
        let mut timeouts = false;
        for name in self.route_names() {
            let resolved = self.resolve(name);
            timeouts |= resolved.timeout.is_some();
            by_path.insert(&name.service, name.method.as_deref(), resolved);
        }
        let every = self.resolve(&Name::every());
        timeouts |= every.timeout.is_some();
        Calls {
            by_path,
            every,
            timeouts,
        }
    }

    /// The middleware's dependencies for this config: one per name it gives, routed by the
    /// call's path (a method's, then a service's), and every other call's as the default (the
    /// config for every method, or one attempt). Each runs its closest method config's policy,
    /// carries a key where a name that covers it is marked non-idempotent, sends gRPC's
    /// attempt headers, and pays its retries from the channel's throttling, or else from one
    /// budget that every method shares.
    pub(crate) fn routes(&self) -> Routes {
        let budget = self.budget.clone().unwrap_or_default();
        let every = Name::every();
        let mut routes = Routes::new(self.dependency(&every, &budget));
        for name in self.route_names() {
            let dependency = self.dependency(name, &budget);
            routes.add_path(&name.service, name.method.as_deref(), dependency);
        }
        routes
    }

    /// The dependency of the calls `name` names.
    fn dependency(&self, name: &Name, budget: &RetryBudget) -> Dependency {
        let resolved = self.resolve(name);
        let (policy, rules) = resolved
            .policy
            .map_or_else(one_attempt, MethodPolicy::to_policy);
        let dependency = Dependency::new(&format!("grpc {name}"), policy);
        self.made(dependency, rules, resolved.keyed, budget)
    }

    /// `dependency` under gRPC's `rules` with the channel's throttling or else `budget`, a key
    /// if `keyed`, and gRPC's attempt headers.
    fn made(
        &self,
        mut dependency: Dependency,
        rules: GrpcRules,
        keyed: bool,
        budget: &RetryBudget,
    ) -> Dependency {
        dependency = match &self.throttling {
            Some(_) => dependency.without_budget(),
            None => dependency.with_budget(budget.clone()),
        };
        dependency.rules = Arc::new(rules.with_throttling(self.throttling.clone()));
        if !keyed {
            dependency = dependency.without_idempotency_keys();
        }
        dependency
    }

    /// Reads a gRPC service config: its `methodConfig`s' `name`s, `retryPolicy`s,
    /// `hedgingPolicy`s and `timeout`s, and its `retryThrottling`. Each method config stands
    /// for its names whole, as grpc-go reads it: a method named in a config of its own runs
    /// under that config's policy and timeout, or none, whatever its service's says. Other
    /// fields (a load balancer's, `waitForReady`, message size limits) are not this layer's
    /// and are passed over; `retryPolicy.perAttemptRecvTimeout` is refused by name, as this
    /// layer does not carry it out.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] naming the field, as A6 validates a service config: JSON that is not
    /// an object, a name or field of the wrong type, a name twice, a `retryPolicy` that breaks
    /// [`GrpcRetryPolicyBuilder::build`]'s rules or a `hedgingPolicy` that breaks
    /// [`GrpcHedgingPolicyBuilder::build`](crate::grpc::GrpcHedgingPolicyBuilder::build)'s, both in
    /// one method config, a `retryThrottling` out of range.
    pub fn from_json(json: &str) -> Result<Self, InvalidConfig> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| InvalidConfig::new(CONFIG, format!("not JSON: {e}")))?;
        let Value::Object(root) = value else {
            return Err(InvalidConfig::new(CONFIG, "must be a JSON object".into()));
        };
        let mut config = GrpcConfig::new();
        if let Some(methods) = root.get("methodConfig") {
            let Value::Array(methods) = methods else {
                return Err(field("methodConfig", "must be an array"));
            };
            // Each name once in the whole config, as grpc-go refuses a duplicated name: the
            // entry that named it first, by name.
            let mut named = std::collections::HashMap::new();
            for (i, method) in methods.iter().enumerate() {
                config = config.read_method(i, method, &mut named)?;
            }
        }
        if let Some(throttling) = root.get("retryThrottling") {
            let number = |key: &str| {
                throttling.get(key).and_then(Value::as_f64).ok_or_else(|| {
                    field(
                        &format!("retryThrottling.{key}"),
                        "is required, and must be a number",
                    )
                })
            };
            let throttling = RetryThrottling::new(number("maxTokens")?, number("tokenRatio")?)
                .map_err(|e| field("retryThrottling", e.message()))?;
            config.throttling = Some(throttling);
        }
        Ok(config)
    }

    fn read_method(
        mut self,
        i: usize,
        method: &Value,
        named: &mut std::collections::HashMap<Name, usize>,
    ) -> Result<Self, InvalidConfig> {
        let at = format!("methodConfig[{i}]");
        let policy = match (method.get("retryPolicy"), method.get("hedgingPolicy")) {
            (None, None) => None,
            (Some(policy), None) => Some(MethodPolicy::Retry(read_policy(
                &format!("{at}.retryPolicy"),
                policy,
            )?)),
            (None, Some(policy)) => Some(MethodPolicy::Hedge(read_hedging(
                &format!("{at}.hedgingPolicy"),
                policy,
            )?)),
            (Some(_), Some(_)) => {
                return Err(field(
                    &at,
                    "sets both retryPolicy and hedgingPolicy: A6 allows one of them",
                ));
            }
        };
        let timeout = match method.get("timeout") {
            None => None,
            Some(value) => {
                let here = format!("{at}.timeout");
                let d = value
                    .as_str()
                    .and_then(proto_duration)
                    .ok_or_else(|| field(&here, "must be a duration such as \"2s\""))?;
                Some(method_timeout(d).map_err(|e| field(&here, &e))?)
            }
        };
        let names = match method.get("name") {
            Some(Value::Array(names)) => names.as_slice(),
            None => &[],
            Some(_) => return Err(field(&format!("{at}.name"), "must be an array")),
        };
        for (j, name) in names.iter().enumerate() {
            let here = format!("{at}.name[{j}]");
            let text = |key: &str| match name.get(key) {
                None => Ok(""),
                Some(Value::String(s)) => Ok(s.as_str()),
                Some(_) => Err(field(&format!("{here}.{key}"), "must be a string")),
            };
            let (service, method_name) = (text("service")?, text("method")?);
            if service.is_empty() && !method_name.is_empty() {
                return Err(field(&here, "names a method without its service"));
            }
            let name = if method_name.is_empty() {
                service.to_owned()
            } else {
                format!("{service}/{method_name}")
            };
            let name = Name::parse(&name).map_err(|e| field(&here, e.message()))?;
            if let Some(first) = named.get(&name) {
                return Err(field(
                    &here,
                    &format!(
                        "names {name} again (methodConfig[{first}] named it first): a method has \
                         one method config"
                    ),
                ));
            }
            named.insert(name.clone(), i);
            // New to this config (every name is once); kept without a policy or a timeout too,
            // as it stands for its methods whole.
            let at = self.entry(name);
            self.methods[at].policy = policy;
            self.methods[at].timeout = timeout;
        }
        Ok(self)
    }
}

/// A method with no retry policy: one attempt, its answer judged as gRPC's.
fn one_attempt() -> (RetryPolicy, GrpcRules) {
    let any = Duration::from_millis(1);
    GrpcRules::retrying(1, (any, any, 2000), CodeSet::default())
}

/// A method-level timeout, if it is one this layer can keep: above zero, and not longer than
/// a gRPC duration holds; else what is wrong with it.
fn method_timeout(timeout: Duration) -> Result<Duration, String> {
    if timeout.is_zero() {
        return Err("is zero: every call would fail at once; leave it out for none".into());
    }
    if in_range(timeout, "timeout").is_err() {
        return Err(format!(
            "({timeout:?}) is longer than a gRPC duration holds (about 292 years, as grpc-go \
             reads it): use a shorter one"
        ));
    }
    Ok(timeout)
}

/// A service config's `retryPolicy` at `at`.
fn read_policy(at: &str, policy: &Value) -> Result<GrpcRetryPolicy, InvalidConfig> {
    let get = |key: &str| policy.get(key);
    if get("perAttemptRecvTimeout").is_some() {
        return Err(field(
            &format!("{at}.perAttemptRecvTimeout"),
            "is not carried out by this layer (each attempt runs to the call's deadline): \
             remove it, or give the call a shorter deadline",
        ));
    }
    let mut builder = GrpcRetryPolicy::builder();
    if let Some(attempts) = get("maxAttempts") {
        let n = attempts
            .as_u64()
            .ok_or_else(|| field(&format!("{at}.maxAttempts"), "must be a whole number"))?;
        builder = builder.max_attempts(u32::try_from(n).unwrap_or(u32::MAX));
    }
    for key in ["initialBackoff", "maxBackoff"] {
        if let Some(value) = get(key) {
            let d = value.as_str().and_then(proto_duration).ok_or_else(|| {
                field(
                    &format!("{at}.{key}"),
                    "must be a duration such as \"0.1s\"",
                )
            })?;
            builder = if key == "initialBackoff" {
                builder.initial_backoff(d)
            } else {
                builder.max_backoff(d)
            };
        }
    }
    match get("backoffMultiplier") {
        Some(m) => {
            let m = m
                .as_f64()
                .ok_or_else(|| field(&format!("{at}.backoffMultiplier"), "must be a number"))?;
            builder = builder.backoff_multiplier(m);
        }
        None => return Err(field(&format!("{at}.backoffMultiplier"), "is required")),
    }
    builder = builder.retryable_codes(read_codes(at, "retryableStatusCodes", policy)?);
    builder
        .build()
        .map_err(|e| InvalidConfig::new(CONFIG, format!("{at}: {}", e.message())))
}

/// A service config's `hedgingPolicy` at `at`.
fn read_hedging(at: &str, policy: &Value) -> Result<GrpcHedgingPolicy, InvalidConfig> {
    let mut builder = GrpcHedgingPolicy::builder();
    if let Some(attempts) = policy.get("maxAttempts") {
        let n = attempts
            .as_u64()
            .ok_or_else(|| field(&format!("{at}.maxAttempts"), "must be a whole number"))?;
        builder = builder.max_attempts(u32::try_from(n).unwrap_or(u32::MAX));
    }
    if let Some(delay) = policy.get("hedgingDelay") {
        let d = delay.as_str().and_then(proto_duration).ok_or_else(|| {
            field(
                &format!("{at}.hedgingDelay"),
                "must be a duration such as \"0.5s\"",
            )
        })?;
        builder = builder.hedging_delay(d);
    }
    let codes = read_codes(at, "nonFatalStatusCodes", policy)?;
    builder
        .non_fatal_codes(codes)
        .build()
        .map_err(|e| InvalidConfig::new(CONFIG, format!("{at}: {}", e.message())))
}

/// The status codes of the array `key` at `at` (names or numbers); none when it is absent.
fn read_codes(at: &str, key: &str, policy: &Value) -> Result<Vec<i32>, InvalidConfig> {
    let Some(codes) = policy.get(key) else {
        return Ok(Vec::new());
    };
    let Value::Array(codes) = codes else {
        return Err(field(&format!("{at}.{key}"), "must be an array"));
    };
    let mut read = Vec::with_capacity(codes.len());
    for (k, code) in codes.iter().enumerate() {
        let number = match code {
            Value::String(name) => code_named(name).map(i32::from),
            Value::Number(n) => n.as_i64().and_then(|n| i32::try_from(n).ok()),
            _ => None,
        }
        .ok_or_else(|| {
            field(
                &format!("{at}.{key}[{k}]"),
                &format!("{code} is not a gRPC status code"),
            )
        })?;
        read.push(number);
    }
    Ok(read)
}

/// The error of the field at `at`.
fn field(at: &str, what: &str) -> InvalidConfig {
    InvalidConfig::new(CONFIG, format!("{at} {what}"))
}

/// A protobuf JSON duration: seconds, with up to nine decimals, and an `s` (`"0.25s"`).
pub(crate) fn proto_duration(text: &str) -> Option<Duration> {
    let number = text.strip_suffix('s')?;
    let (secs, frac) = number.split_once('.').unwrap_or((number, "0"));
    if secs.is_empty()
        || frac.is_empty()
        || frac.len() > 9
        || !secs.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let secs: u64 = secs.parse().ok()?;
    let nanos: u32 = format!("{frac:0<9}").parse().ok()?;
    Some(Duration::new(secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A policy of 7 attempts, A6's cap raised on purpose.
    fn raised_to_seven() -> GrpcRetryPolicy {
        let ms = Duration::from_millis;
        GrpcRetryPolicy::builder()
            .max_attempts(7)
            .allow_attempts_above_five(7)
            .initial_backoff(ms(100))
            .max_backoff(ms(1000))
            .retryable_codes([14])
            .build()
            .unwrap()
    }

    /// On a call, an override shortens the call's deadline and never drops it, and asks at
    /// most A6's cap of attempts (or a cap its method's policy raised); what else it says
    /// stays.
    #[test]
    fn on_a_call_an_override_shortens_the_deadline_and_stays_within_the_cap() {
        let ms = Duration::from_millis;
        let calls = GrpcConfig::new().calls();
        let on = |timeout, over| calls.overriding("/a.B/C", timeout, over);
        let call = Some(ms(200));
        let many = RetryOverride::new().max_attempts(9);
        let capped = on(call, many);
        assert_eq!(
            (capped.deadline_set(), capped.attempts_set()),
            (call, Some(5))
        );
        assert_eq!(
            on(call, RetryOverride::new().deadline(ms(50))).deadline_set(),
            Some(ms(50))
        );
        assert_eq!(
            on(call, RetryOverride::new().deadline(ms(500))).deadline_set(),
            call
        );
        // A call without a deadline keeps the override's; one that sets neither is as asked.
        let own = RetryOverride::new().deadline(ms(500));
        assert_eq!(on(None, own), own);
        let plain = RetryOverride::new().no_retries();
        assert_eq!(on(None, plain), plain);
        assert_eq!(on(call, plain), plain.deadline(ms(200)), "no_retries stays");
        // A method whose policy raised the cap lets more through.
        let raised = raised_to_seven();
        let raised = GrpcConfig::new().retry("a.B", raised).unwrap().calls();
        let more = raised.overriding("/a.B/C", None, many);
        assert_eq!(more.attempts_set(), Some(7));
    }

    /// What grpc-go and grpc-java run, this reads: a `maxBackoff` below `initialBackoff` (every
    /// wait capped at it), a hedging policy without `nonFatalStatusCodes` (every failure
    /// fatal); and what grpc-go refuses, it refuses: a name in two method configs, whether or
    /// not the first has a policy.
    #[test]
    fn the_service_config_is_read_as_grpc_go_and_grpc_java_read_it() {
        let low_cap = r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 3,
            "initialBackoff": "2s", "maxBackoff": "1s", "backoffMultiplier": 2,
            "retryableStatusCodes": [14]}}]}"#;
        let config = GrpcConfig::from_json(low_cap).unwrap();
        let Some(MethodPolicy::Retry(policy)) = config.for_path("/a.B/C") else {
            panic!("a retry policy")
        };
        let (run, rules) = policy.to_policy();
        for retry in 0..3 {
            let ceiling = crate::engine::backoff::a6_ceiling(
                run.base_delay(),
                run.max_delay(),
                rules.multiplier_milli,
                retry,
            );
            assert_eq!(ceiling, Duration::from_secs(1), "capped at maxBackoff");
        }
        let no_codes = r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 3}}]}"#;
        let config = GrpcConfig::from_json(no_codes).unwrap();
        let Some(MethodPolicy::Hedge(hedging)) = config.for_path("/a.B/C") else {
            panic!("a hedging policy")
        };
        assert!((0..=16).all(|code| !hedging.is_non_fatal(code)));
        for first in [
            "",
            r#", "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}"#,
        ] {
            let twice = format!(
                r#"{{"methodConfig": [{{"name": [{{"service": "a.B"}}]{first}}},
                  {{"name": [{{"service": "x.Y"}}, {{"service": "a.B"}}], "hedgingPolicy": {{"maxAttempts": 2}}}}]}}"#
            );
            let err = GrpcConfig::from_json(&twice).unwrap_err().to_string();
            assert!(
                err.contains(
                    "methodConfig[1].name[1] names a.B again (methodConfig[0] named it first)"
                ),
                "{err}"
            );
        }
    }

    #[test]
    fn backoffs_longer_than_a_grpc_duration_are_refused_at_build() {
        let longest = crate::engine::grpc::LONGEST;
        let build = |initial, max| {
            GrpcRetryPolicy::builder()
                .max_attempts(2)
                .initial_backoff(initial)
                .max_backoff(max)
                .retryable_codes([14])
                .build()
        };
        assert!(build(longest, longest).is_ok());
        let err = build(Duration::from_secs(1), Duration::MAX).unwrap_err();
        assert!(err.to_string().contains("maxBackoff"), "{err}");
        let err = build(Duration::MAX, Duration::MAX).unwrap_err();
        assert!(err.to_string().contains("initialBackoff"), "{err}");
    }

    fn policy(attempts: u32) -> GrpcRetryPolicy {
        GrpcRetryPolicy::builder()
            .max_attempts(attempts)
            .initial_backoff(Duration::from_millis(100))
            .max_backoff(Duration::from_secs(1))
            .backoff_multiplier(1.5)
            .retryable_codes([14, 4])
            .build()
            .unwrap()
    }

    const JSON: &str = r#"{
      "loadBalancingConfig": [{"round_robin": {}}],
      "methodConfig": [
        {"name": [{"service": "echo.Echo", "method": "Say"}, {"service": "echo.Other"}],
         "timeout": "1s",
         "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.1s", "maxBackoff": "1s",
                         "backoffMultiplier": 1.5,
                         "retryableStatusCodes": ["UNAVAILABLE", "deadline_exceeded"]}},
        {"name": [{}], "retryPolicy": {"maxAttempts": 9, "initialBackoff": "0.1s",
                         "maxBackoff": "1s", "backoffMultiplier": 1.5,
                         "retryableStatusCodes": [14, 4]}}
      ],
      "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1}
    }"#;

    #[test]
    fn a_service_config_reads_to_the_config_built_in_code() {
        let read = GrpcConfig::from_json(JSON).unwrap();
        let built = GrpcConfig::new()
            .retry("echo.Echo/Say", policy(4))
            .unwrap()
            .retry("echo.Other", policy(4))
            .unwrap()
            .retry("", policy(5))
            .unwrap()
            .timeout("echo.Echo/Say", Duration::from_secs(1))
            .unwrap()
            .timeout("echo.Other", Duration::from_secs(1))
            .unwrap()
            .retry_throttling(RetryThrottling::new(10.0, 0.1).unwrap());
        assert_eq!(read, built);
        assert_eq!(
            read.methods[2].policy.unwrap().max_attempts(),
            5,
            "9 is cut to A6's 5"
        );
        assert_ne!(read, GrpcConfig::new(), "it is not any config");
        // Each part counts: the methods, the throttling's parameters, the buffer limits.
        let base = || GrpcConfig::new().retry("a.B", policy(2)).unwrap();
        assert_eq!(base(), base());
        assert_ne!(base(), GrpcConfig::new().retry("a.B", policy(3)).unwrap());
        let throttled = |max| base().retry_throttling(RetryThrottling::new(max, 0.1).unwrap());
        assert_eq!(throttled(3.0), throttled(3.0));
        assert_ne!(throttled(3.0), throttled(4.0));
        assert_ne!(base(), throttled(3.0));
        assert_ne!(base(), base().buffer_limits(1, 2));
        assert_ne!(base().buffer_limits(1, 2), base().buffer_limits(1, 3));
    }

    #[test]
    fn a_hedging_policy_reads_as_it_is_built_and_a_name_takes_one_policy() {
        let read = GrpcConfig::from_json(
            r#"{"methodConfig": [{"name": [{"service": "echo.Echo", "method": "Get"}],
                "hedgingPolicy": {"maxAttempts": 4, "hedgingDelay": "0.5s",
                                  "nonFatalStatusCodes": ["UNAVAILABLE", 13, "ABORTED"]}}]}"#,
        )
        .unwrap();
        let hedging = GrpcHedgingPolicy::builder()
            .max_attempts(4)
            .hedging_delay(Duration::from_millis(500))
            .non_fatal_codes([14, 13, 10])
            .build()
            .unwrap();
        let built = GrpcConfig::new().hedge("echo.Echo/Get", hedging).unwrap();
        assert_eq!(read, built);
        assert_eq!(
            read.for_path("/echo.Echo/Get"),
            Some(MethodPolicy::Hedge(hedging))
        );
        // No delay is every copy at once.
        let at_once = GrpcConfig::from_json(
            r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2, "nonFatalStatusCodes": [14]}}]}"#,
        )
        .unwrap();
        let Some(MethodPolicy::Hedge(p)) = at_once.for_path("/a.B/C") else {
            panic!("a hedging policy");
        };
        assert_eq!(p.hedging_delay(), Duration::ZERO);
        // One policy per name, retry or hedging.
        let err = built.retry("echo.Echo/Get", policy(2)).unwrap_err();
        assert!(err.to_string().contains("named twice"), "{err}");
        let err = GrpcConfig::new()
            .retry("a.B", policy(2))
            .unwrap()
            .hedge("a.B", hedging)
            .unwrap_err();
        assert!(err.to_string().contains("named twice"), "{err}");
        // Its dependency runs the hedging policy.
        let routes = GrpcConfig::new().hedge("a.B", hedging).unwrap().routes();
        let rules = &routes.named("grpc a.B").unwrap().rules;
        assert_eq!(rules.course(), Some(Duration::from_millis(500)));
    }

    #[test]
    fn the_closest_name_serves_a_call() {
        let config = GrpcConfig::from_json(JSON).unwrap();
        let at = |path| config.for_path(path).map(|p| p.max_attempts());
        assert_eq!(at("/echo.Echo/Say"), Some(4));
        assert_eq!(at("/echo.Other/Any"), Some(4));
        assert_eq!(at("/echo.Echo/Shout"), Some(5), "every method's");
        assert_eq!(at("no-slash"), None);
        // A method marked non-idempotent keeps its service's policy, and carries a key.
        let keyed = config.non_idempotent("echo.Other/Pay").unwrap();
        let resolved = |config: &GrpcConfig, name: &str| {
            let r = config.resolve(&Name::parse(name).unwrap());
            (r.policy, r.keyed)
        };
        let four = Some(MethodPolicy::Retry(policy(4)));
        assert_eq!(resolved(&keyed, "echo.Other/Pay"), (four, true));
        assert_eq!(resolved(&keyed, "echo.Other/Read"), (four, false));
        assert_eq!(keyed.for_path("/echo.Other/Pay"), four);
        // The table a layer reads per call says the same, by path.
        let calls = keyed.calls();
        assert_eq!(
            (
                calls.of("/echo.Other/Pay").policy,
                calls.of("/echo.Other/Pay").keyed
            ),
            (four, true)
        );
        assert_eq!(
            calls
                .of("/echo.Echo/Shout")
                .policy
                .map(|p| p.max_attempts()),
            Some(5)
        );
        assert_eq!(
            calls.of("no-slash").policy.map(|p| p.max_attempts()),
            Some(5)
        );
        // A name marked alone takes the closest policy that covers it: every method's here,
        // not another service's.
        let alone = GrpcConfig::new()
            .retry("", policy(5))
            .unwrap()
            .retry("x.Y", policy(2))
            .unwrap()
            .non_idempotent("a.B/C")
            .unwrap();
        assert_eq!(
            resolved(&alone, "a.B/C"),
            (Some(MethodPolicy::Retry(policy(5))), true)
        );
        assert_eq!(GrpcConfig::new().for_path("/a.B/C"), None);
        let named = Name::parse("a.B/C").unwrap();
        assert_eq!(named.to_string(), "a.B/C");
        assert_eq!(Name::of_path("/a.B/C"), Some(named));
        assert_eq!(Name::of_path("a.B"), None);
        for bad in ["a.B/", "/C", "a/b/c"] {
            assert!(Name::parse(bad).is_err(), "{bad}");
        }
    }

    /// Issue 64, defect 9: the method-level `timeout` is read, and each method config stands
    /// for its names whole, as grpc-go's `getMethodConfig` takes the closest one: a method
    /// named in a config of its own that sets only a timeout has no retry policy, whatever
    /// its service's says (before, it fell through to the service's policy, and the timeout
    /// was dropped).
    #[test]
    fn a_method_config_stands_for_its_methods_whole_as_grpc_go_reads_it() {
        let json = r#"{"methodConfig": [
          {"name": [{"service": "a.B"}], "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}},
          {"name": [{"service": "a.B", "method": "Slow"}], "timeout": "0.25s"},
          {"name": [{}], "timeout": "5s"}]}"#;
        let config = GrpcConfig::from_json(json).unwrap();
        let calls = config.calls();
        let of = |path| {
            let r = calls.of(path);
            (r.policy.map(|p| p.max_attempts()), r.timeout)
        };
        let ms = Duration::from_millis;
        assert_eq!(of("/a.B/Slow"), (None, Some(ms(250))));
        assert_eq!(
            of("/a.B/Fast"),
            (Some(3), None),
            "the service's config, whole"
        );
        assert_eq!(of("/c.D/E"), (None, Some(ms(5000))), "every method's");
        assert!(calls.timeouts);
        // A call's deadline: the earlier of its own and its method's.
        assert_eq!(calls.deadline("/a.B/Slow", None), Some(ms(250)));
        assert_eq!(calls.deadline("/a.B/Slow", Some(ms(100))), Some(ms(100)));
        assert_eq!(calls.deadline("/a.B/Slow", Some(ms(900))), Some(ms(250)));
        assert_eq!(calls.deadline("/a.B/Fast", Some(ms(900))), Some(ms(900)));
        assert_eq!(calls.deadline("/a.B/Fast", None), None);
        // An override's attempts stop at A6's cap, or a policy's raised one.
        assert_eq!(calls.most_attempts("/a.B/Fast"), GRPC_MAX_ATTEMPTS);
        let raised = raised_to_seven();
        let raised = GrpcConfig::new().retry("x.Y", raised).unwrap().calls();
        assert_eq!(raised.most_attempts("/x.Y/Z"), 7);
        // The same built in code; and a config without timeouts looks none up.
        let built = GrpcConfig::new()
            .retry(
                "a.B",
                GrpcRetryPolicy::builder()
                    .max_attempts(3)
                    .initial_backoff(ms(100))
                    .max_backoff(ms(1000))
                    .retryable_codes([14])
                    .build()
                    .unwrap(),
            )
            .unwrap()
            .timeout("a.B/Slow", ms(250))
            .unwrap()
            .timeout("", ms(5000))
            .unwrap();
        assert_eq!(built, config);
        assert!(!GrpcConfig::new().calls().timeouts);
        // A timeout is given once per name, above zero, within a gRPC duration.
        let err = built.clone().timeout("a.B/Slow", ms(1)).unwrap_err();
        assert!(
            err.to_string()
                .contains("a.B/Slow is given a timeout twice"),
            "{err}"
        );
        let err = GrpcConfig::new()
            .timeout("a.B", Duration::ZERO)
            .unwrap_err();
        assert!(
            err.to_string().contains("the timeout of a.B is zero"),
            "{err}"
        );
        let err = GrpcConfig::new().timeout("a.B", Duration::MAX).unwrap_err();
        assert!(
            err.to_string().contains("longer than a gRPC duration"),
            "{err}"
        );
    }

    /// Issue 64, defect 9: building, reading and finding a call's method config take time
    /// independent of the number of method configs (before: a scan of every entry for each
    /// name given, and for each call). 20,000 names, each found by its call's path.
    #[test]
    fn twenty_thousand_method_configs_are_each_found_by_name() {
        let mut config = GrpcConfig::new();
        let mut json = String::from(r#"{"methodConfig": ["#);
        for i in 0..20_000 {
            let name = format!("s{}.S/M{i}", i % 100);
            let attempts = 2 + i % 4;
            let policy = GrpcRetryPolicy::builder()
                .max_attempts(attempts)
                .initial_backoff(Duration::from_millis(100))
                .max_backoff(Duration::from_secs(1))
                .retryable_codes([14])
                .build()
                .unwrap();
            config = config.retry(&name, policy).unwrap();
            let (service, method) = name.split_once('/').unwrap();
            if i > 0 {
                json.push(',');
            }
            json.push_str(&format!(
                r#"{{"name": [{{"service": "{service}", "method": "{method}"}}], "retryPolicy": {{"maxAttempts": {attempts}, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}}}"#
            ));
        }
        json.push_str("]}");
        let read = GrpcConfig::from_json(&json).unwrap();
        assert_eq!(read, config);
        let calls = config.calls();
        let routes = config.routes();
        for i in (0..20_000).step_by(997) {
            let path = format!("/s{}.S/M{i}", i % 100);
            let attempts = calls.of(&path).policy.map(|p| p.max_attempts());
            assert_eq!(attempts, Some(2 + i % 4), "{path}");
            let url: url::Url = format!("http://x.example{path}").parse().unwrap();
            let dependency = routes.pick(&url, || path.as_str());
            assert_eq!(dependency.policy.max_attempts(), 2 + i % 4, "{path}");
        }
    }

    #[test]
    fn invalid_service_configs_are_refused_naming_the_field() {
        let cases = [
            ("[]", "must be a JSON object"),
            ("{", "not JSON"),
            (r#"{"methodConfig": {}}"#, "methodConfig must be an array"),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}]}"#,
                "methodConfig[0].retryPolicy: maxAttempts is required",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 1, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}]}"#,
                "maxAttempts (1) must be at least 2",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}]}"#,
                "must be above zero",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}]}"#,
                "methodConfig[0].retryPolicy.initialBackoff must be a duration",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "retryableStatusCodes": [14]}}]}"#,
                "methodConfig[0].retryPolicy.backoffMultiplier is required",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 0, "retryableStatusCodes": [14]}}]}"#,
                "backoffMultiplier (0) must be above zero",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": []}}]}"#,
                "retryableStatusCodes must name at least one code",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["NOPE"]}}]}"#,
                "methodConfig[0].retryPolicy.retryableStatusCodes[0] \"NOPE\" is not a gRPC status code",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [17]}}]}"#,
                "17 is not a gRPC status code",
            ),
            (
                r#"{"methodConfig": [{"name": [{"method": "Say"}]}]}"#,
                "methodConfig[0].name[0] names a method without its service",
            ),
            (
                r#"{"methodConfig": [{"name": [{"service": 3}]}]}"#,
                "methodConfig[0].name[0].service must be a string",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"nonFatalStatusCodes": [14]}}]}"#,
                "methodConfig[0].hedgingPolicy: maxAttempts is required",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 1, "nonFatalStatusCodes": [14]}}]}"#,
                "methodConfig[0].hedgingPolicy: maxAttempts (1) must be at least 2",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2, "nonFatalStatusCodes": [14, 99]}}]}"#,
                "is not a gRPC status code",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2, "nonFatalStatusCodes": ["SOON"]}}]}"#,
                "methodConfig[0].hedgingPolicy.nonFatalStatusCodes[0] \"SOON\" is not a gRPC status code",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2, "hedgingDelay": "5ms", "nonFatalStatusCodes": [14]}}]}"#,
                "methodConfig[0].hedgingPolicy.hedgingDelay must be a duration",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2, "nonFatalStatusCodes": {}}}]}"#,
                "methodConfig[0].hedgingPolicy.nonFatalStatusCodes must be an array",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2, "nonFatalStatusCodes": [14]}, "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}]}"#,
                "methodConfig[0] sets both retryPolicy and hedgingPolicy",
            ),
            (
                r#"{"retryThrottling": {"maxTokens": 0, "tokenRatio": 0.1}}"#,
                "retryThrottling maxTokens (0) must be above 0",
            ),
            (
                r#"{"retryThrottling": {"maxTokens": 10}}"#,
                "retryThrottling.tokenRatio is required",
            ),
        ];
        let more = [
            (
                r#"{"methodConfig": [{"name": [{}], "timeout": "0s"}]}"#,
                "methodConfig[0].timeout is zero",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "timeout": 2}]}"#,
                "methodConfig[0].timeout must be a duration",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "timeout": "9223372037s"}]}"#,
                "methodConfig[0].timeout (9223372037s) is longer than a gRPC duration holds",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14], "perAttemptRecvTimeout": "1s"}}]}"#,
                "methodConfig[0].retryPolicy.perAttemptRecvTimeout is not carried out",
            ),
        ];
        let ok = [
            (
                r#"{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "OK"]}}]}"#,
                "retryableStatusCodes names OK, which is no failure",
            ),
            (
                r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2, "nonFatalStatusCodes": [0]}}]}"#,
                "nonFatalStatusCodes names OK, which is no failure",
            ),
        ];
        for (json, says) in cases.into_iter().chain(more).chain(ok) {
            let err = GrpcConfig::from_json(json).unwrap_err().to_string();
            assert!(err.contains(says), "{json}\n  said: {err}\n  not: {says}");
        }
        let twice = r#"{"methodConfig": [
          {"name": [{"service": "a.B"}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}},
          {"name": [{"service": "a.B"}], "retryPolicy": {"maxAttempts": 2, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": [14]}}]}"#;
        let err = GrpcConfig::from_json(twice).unwrap_err().to_string();
        assert!(
            err.contains("methodConfig[1].name[0] names a.B again"),
            "{err}"
        );
        let err = GrpcConfig::new()
            .retry("a.B", policy(2))
            .unwrap()
            .retry("a.B", policy(2))
            .unwrap_err();
        assert!(err.to_string().contains("a.B is named twice"), "{err}");
    }

    #[test]
    fn attempts_above_five_are_cut_unless_raised_on_purpose() {
        let build = |b: GrpcRetryPolicyBuilder| {
            b.initial_backoff(Duration::from_millis(1))
                .max_backoff(Duration::from_millis(1))
                .retryable_codes([14])
                .build()
                .unwrap()
                .max_attempts()
        };
        assert_eq!(build(GrpcRetryPolicy::builder().max_attempts(9)), 5);
        assert_eq!(
            build(
                GrpcRetryPolicy::builder()
                    .max_attempts(9)
                    .allow_attempts_above_five(7)
            ),
            7
        );
        assert_eq!(
            build(
                GrpcRetryPolicy::builder()
                    .max_attempts(3)
                    .allow_attempts_above_five(2)
            ),
            3,
            "the cap is never below A6's"
        );
    }

    #[test]
    fn a_policy_reads_back_what_it_was_given_and_runs_as_the_crate_s() {
        let p = policy(4);
        assert_eq!(p.initial_backoff(), Duration::from_millis(100));
        assert_eq!(p.max_backoff(), Duration::from_secs(1));
        assert_eq!(p.backoff_multiplier(), 1.5);
        assert!(p.retries_code(14) && p.retries_code(4) && !p.retries_code(2));
        assert!(!p.retries_code(-1) && !p.retries_code(300));
        let (run, rules) = p.to_policy();
        assert_eq!(run.max_attempts(), 4);
        assert_eq!(run.base_delay(), Duration::from_millis(100));
        assert_eq!(run.max_delay(), Duration::from_secs(1));
        assert_eq!((rules.codes, rules.multiplier_milli), (p.codes(), 1500));
        assert!(!run.retry_after_jitter() && run.retry_after_fields());
        assert!(!run.rate_limit_fields() && !run.should_retry_fields());
        assert_eq!(run.deadline(), crate::engine::grpc::NO_DEADLINE);
        assert_eq!(
            run.to_builder().build().unwrap(),
            run,
            "an override keeps its numbers"
        );
    }

    #[test]
    fn a_proto_duration_is_seconds_with_up_to_nine_decimals() {
        assert_eq!(proto_duration("1s"), Some(Duration::from_secs(1)));
        assert_eq!(proto_duration("0.1s"), Some(Duration::from_millis(100)));
        assert_eq!(
            proto_duration("0.000000001s"),
            Some(Duration::from_nanos(1))
        );
        for bad in [
            "1",
            "s",
            ".5s",
            "1.s",
            "-1s",
            "0.0000000001s",
            "1.5ms",
            "1e3s",
        ] {
            assert_eq!(proto_duration(bad), None, "{bad}");
        }
    }

    proptest! {
        /// Any JSON a service config could hold is read or refused, never a panic.
        #[test]
        fn any_retry_policy_json_is_read_or_refused(
            attempts in proptest::option::of(-3i64..10),
            initial in "[0-9.s-]{0,6}",
            multiplier in proptest::option::of(-2.0f64..4.0),
            codes in proptest::collection::vec(-2i64..20, 0..4),
        ) {
            let mut policy = serde_json::Map::new();
            if let Some(a) = attempts { policy.insert("maxAttempts".into(), a.into()); }
            policy.insert("initialBackoff".into(), initial.clone().into());
            policy.insert("maxBackoff".into(), "1s".into());
            if let Some(m) = multiplier { policy.insert("backoffMultiplier".into(), m.into()); }
            policy.insert("retryableStatusCodes".into(), codes.clone().into());
            let json = serde_json::json!({"methodConfig": [{"name": [{}], "retryPolicy": policy}]});
            match GrpcConfig::from_json(&json.to_string()) {
                Ok(config) => {
                    let Some(MethodPolicy::Retry(p)) = config.methods[0].policy else {
                        panic!("a retry policy");
                    };
                    prop_assert!(p.max_attempts() >= 2 && p.max_attempts() <= 5);
                    prop_assert!(!p.initial_backoff().is_zero());
                    prop_assert!(codes.iter().all(|c| p.retries_code(*c as i32)));
                }
                Err(e) => prop_assert!(e.to_string().contains("methodConfig[0].retryPolicy")),
            }
        }
    }
}
