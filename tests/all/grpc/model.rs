//! The gRPC door over random scripts against a small reference model of gRFC A6, through a
//! real tonic server on 127.0.0.1 and a `FakeClock`.
//!
//! One generator draws a method's policy (attempts, backoff, the codes it retries), the
//! channel's throttling, or else a small retry budget of the config's or the layer's default
//! one, whether the method is marked non-idempotent, a deadline or none (from 20 ms, often
//! shorter than the backoff), a per-call `RetryOverride` or none (attempts past A6's cap,
//! `no_retries`, a deadline of its own), and the server's answer to each attempt in order: a
//! trailers-only failure with a code retried or not and a pushback (none, a wait, negative,
//! malformed), or the answer. The model says, call by call, how many attempts reach the
//! server, each wait to the nanosecond (the same seeded draws; a wait that would cross the
//! deadline is waited to it, and the call ends there `DEADLINE_EXCEEDED`), the status or
//! answer the caller gets, the record's attempts and stop reason, and the throttling's or the
//! budget's tokens; and on every attempt, `grpc-previous-rpc-attempts`, no `grpc-timeout`
//! above what is left, and one key per call when the method is keyed. A failure names its
//! seed: `GRPC_SEED=N GRPC_SCRIPTS=M` runs `M` scripts from seed `N`.

use std::collections::VecDeque;
use std::time::Duration;

use reqwest_safe_retry::{
    FakeClock, RandomSource, RetryBudget, RetryOverride, RetryRecord, SeededRng, StopReason,
    grpc::{GrpcConfig, GrpcRetryLayer, GrpcRetryPolicy, RetryThrottling},
};
use tonic::Code;
use tower_layer::Layer;

use super::server::{Act, Script, channel, say, serve, text};

const SCRIPTS: u64 = 500;

struct Gen(SeededRng);

impl Gen {
    fn upto(&mut self, n: u64) -> u64 {
        self.0.next_u64() % (n + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.upto(99) < percent
    }
}

/// The codes a script's server fails with; the policy retries a non-empty subset of the first
/// three.
const CODES: [Code; 4] = [
    Code::Unavailable,
    Code::ResourceExhausted,
    Code::Aborted,
    Code::InvalidArgument,
];
const PUSHBACKS: [&str; 2] = ["-1", "soon"];

#[derive(Debug, Clone)]
struct Plan {
    attempts: u32,
    initial: Duration,
    multiplier: f64,
    retried: Vec<Code>,
    throttling: Option<(f64, f64)>,
    /// Without throttling: a budget of this many tokens (retries cost 1, a first attempt
    /// answered deposits 0.1, no refund, no floor); `None`: the layer's default (10 tokens).
    budget: Option<u32>,
    keyed: bool,
    deadline: Option<Duration>,
    over: Option<Over>,
    calls: usize,
    acts: Vec<Act>,
}

/// A per-call override, on every call of a script.
#[derive(Debug, Clone, Copy)]
enum Over {
    Attempts(u32),
    NoRetries,
    Deadline(Duration),
}

impl Over {
    fn of(self) -> RetryOverride {
        match self {
            Over::Attempts(n) => RetryOverride::new().max_attempts(n),
            Over::NoRetries => RetryOverride::new().no_retries(),
            Over::Deadline(d) => RetryOverride::new().deadline(d),
        }
    }
}

/// A6's cap on attempts, which an override does not pass.
const A6_CAP: u32 = 5;

fn plan(seed: u64) -> Plan {
    let mut g = Gen(SeededRng::new(seed));
    let mut retried: Vec<Code> = CODES[..3]
        .iter()
        .copied()
        .filter(|_| g.chance(60))
        .collect();
    if retried.is_empty() {
        retried.push(Code::Unavailable);
    }
    let throttling = g
        .chance(40)
        .then(|| ((2 + g.upto(8)) as f64, (1 + g.upto(9)) as f64 / 10.0));
    let mut acts = Vec::new();
    let mut failures = 0;
    for _ in 0..g.upto(8) {
        let code = CODES[g.upto(3) as usize];
        let pushback = match g.upto(9) {
            0..=5 => None,
            6..=7 => Some(["0", "40", "250"][g.upto(2) as usize]),
            _ => Some(PUSHBACKS[g.upto(1) as usize]),
        };
        let act = if g.chance(15) {
            // The answer: it ends one call, and the next gets what follows.
            None
        } else {
            failures += 1;
            Some(Act::Fail(code, pushback))
        };
        // With the layer's default budget, fewer failures than its tokens.
        if throttling.is_none() && failures > 9 {
            break;
        }
        // The answer, at once.
        acts.push(act.unwrap_or(Act::Slow(Duration::ZERO)));
    }
    let budget = (throttling.is_none() && g.chance(50)).then(|| 1 + g.upto(3) as u32);
    let deadline = |g: &mut Gen| match g.upto(2) {
        // Often shorter than a backoff or a pushback.
        0 => Duration::from_millis(20 + g.upto(280)),
        _ => Duration::from_millis(300 + 100 * g.upto(27)),
    };
    Plan {
        attempts: 2 + g.upto(3) as u32,
        initial: Duration::from_millis(10 + g.upto(190)),
        multiplier: [1.5, 2.0, 3.0][g.upto(2) as usize],
        retried,
        throttling,
        budget,
        keyed: g.chance(50),
        deadline: g.chance(50).then(|| deadline(&mut g)),
        over: match g.upto(9) {
            0 | 1 => Some(Over::Attempts(1 + g.upto(8) as u32)),
            2 => Some(Over::NoRetries),
            3 => Some(Over::Deadline(deadline(&mut g))),
            _ => None,
        },
        calls: 1 + g.upto(2) as usize,
        acts,
    }
}

impl Plan {
    /// The attempts a call may make: the policy's, or the override's up to A6's cap.
    fn most(&self) -> u32 {
        match self.over {
            Some(Over::Attempts(n)) => n.min(A6_CAP.max(self.attempts)),
            Some(Over::NoRetries) => 1,
            _ => self.attempts,
        }
    }

    /// The call's deadline: its own, or the override's if shorter.
    fn deadline(&self) -> Option<Duration> {
        match (self.deadline, self.over) {
            (Some(call), Some(Over::Deadline(own))) => Some(call.min(own)),
            (None, Some(Over::Deadline(own))) => Some(own),
            (call, _) => call,
        }
    }
}

/// What the model says of one call.
#[derive(Debug, PartialEq)]
struct Expected {
    attempts: u32,
    stop: StopReason,
    /// The status it ends with; `None`: the answer.
    code: Option<Code>,
    waits: Vec<Duration>,
}

/// A6's wait before retry `n` for the draw `x`.
fn a6_wait(p: &Plan, n: u32, x: u64) -> Duration {
    let max = Duration::from_secs(1);
    let factor = p.multiplier.powi(n as i32);
    let secs = p.initial.as_secs_f64() * factor;
    let ceiling = if secs < max.as_secs_f64() {
        Duration::from_secs_f64(secs)
    } else {
        max
    };
    let spread = u64::try_from((ceiling * 2 / 5).as_nanos()).unwrap();
    let drawn = (u128::from(x) * (u128::from(spread) + 1)) >> 64;
    ceiling * 4 / 5 + Duration::from_nanos(drawn as u64)
}

/// The accounts the calls of a script share, in thousandths of a token.
#[derive(Debug)]
struct Accounts {
    /// The channel's throttling: (tokens, max, ratio).
    throttling: Option<(i64, i64, i64)>,
    /// The budget, when the script draws one: (tokens, capacity).
    budget: Option<(i64, i64)>,
}

/// The model of one call, consuming the server's acts.
fn model_call(
    p: &Plan,
    acts: &mut VecDeque<Act>,
    draws: &SeededRng,
    accounts: &mut Accounts,
) -> Expected {
    let (mut attempts, mut waits, mut from) = (0u32, Vec::new(), 0u32);
    let mut waited = Duration::ZERO;
    let deposit = |accounts: &mut Accounts, attempts: u32| {
        if let (1, Some((t, capacity))) = (attempts, accounts.budget.as_mut()) {
            *t = (*t + 100).min(*capacity);
        }
    };
    loop {
        attempts += 1;
        let (code, pushback) = match acts.pop_front() {
            Some(Act::Fail(code, pushback)) => (code, pushback),
            _ => {
                if let Some((t, max, ratio)) = accounts.throttling.as_mut() {
                    *t = (*t + *ratio).min(*max);
                }
                deposit(accounts, attempts);
                let stop = StopReason::Committed;
                return Expected {
                    attempts,
                    stop,
                    code: None,
                    waits,
                };
            }
        };
        let end = |stop, code| Expected {
            attempts,
            stop,
            code: Some(code),
            waits: waits.clone(),
        };
        if !p.retried.contains(&code) {
            deposit(accounts, attempts);
            return end(StopReason::NotRetryable, code);
        }
        let mut allowed = true;
        if let Some((t, max, _)) = accounts.throttling.as_mut() {
            *t = (*t - 1000).max(0);
            allowed = *t * 2 > *max;
        }
        let floor = match pushback {
            None => None,
            Some(ms) => match ms.parse::<i32>() {
                Ok(ms) if ms >= 0 => Some(Duration::from_millis(ms as u64)),
                _ => return end(StopReason::ServerDeclinedRetry, code),
            },
        };
        if !allowed {
            return end(StopReason::BudgetExhausted, code);
        }
        if matches!(p.over, Some(Over::NoRetries)) {
            return end(StopReason::RetriesDisabled, code);
        }
        if attempts >= p.most() {
            return end(StopReason::AttemptsExhausted, code);
        }
        let remaining = p
            .deadline()
            .map_or(Duration::MAX, |d| d.saturating_sub(waited));
        let wait = match floor {
            Some(floor) => {
                from = attempts;
                floor
            }
            None => a6_wait(p, attempts - 1 - from, draws.next_u64()),
        };
        if wait >= remaining {
            // Waited to the deadline, where the call ends as grpc-go's and grpc-java's do.
            let mut waits = waits.clone();
            waits.push(remaining);
            return Expected {
                attempts,
                stop: StopReason::DeadlineReached,
                code: Some(Code::DeadlineExceeded),
                waits,
            };
        }
        if let Some((t, _)) = accounts.budget.as_mut() {
            if *t < 1000 {
                return end(StopReason::BudgetExhausted, code);
            }
            *t -= 1000;
        }
        waited += wait;
        waits.push(wait);
    }
}

async fn run(seed: u64) {
    let p = plan(seed);
    let why = format!("seed {seed}: {p:?}");
    // The server answers each attempt with the next act, the model reads the same ones.
    let script = Script::new(p.acts.iter().cloned());
    let uri = serve(&script).await;
    let policy = GrpcRetryPolicy::builder()
        .max_attempts(p.attempts)
        .initial_backoff(p.initial)
        .max_backoff(Duration::from_secs(1))
        .backoff_multiplier(p.multiplier)
        .retryable_codes(p.retried.iter().copied())
        .build()
        .unwrap();
    let mut config = GrpcConfig::new().retry("echo.Echo", policy).unwrap();
    if p.keyed {
        config = config.non_idempotent("echo.Echo/Say").unwrap();
    }
    let throttling = p
        .throttling
        .map(|(max, ratio)| RetryThrottling::new(max, ratio).unwrap());
    if let Some(throttling) = &throttling {
        config = config.retry_throttling(throttling.clone());
    }
    let budget = p.budget.map(|tokens| {
        RetryBudget::builder()
            .capacity(f64::from(tokens))
            .floor_per_sec(0.0)
            .build()
            .unwrap()
    });
    if let Some(budget) = &budget {
        config = config.retry_budget(budget.clone());
    }
    let clock = FakeClock::new();
    let layer = GrpcRetryLayer::new(config)
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(seed));
    let service = layer.layer(channel(&uri));

    let mut acts: VecDeque<Act> = p.acts.iter().cloned().collect();
    let draws = SeededRng::new(seed);
    let mut accounts = Accounts {
        throttling: p.throttling.map(|(max, ratio)| {
            (
                (max * 1000.0) as i64,
                (max * 1000.0) as i64,
                (ratio * 1000.0).round() as i64,
            )
        }),
        budget: p.budget.map(|t| (i64::from(t) * 1000, i64::from(t) * 1000)),
    };
    let mut arrivals = 0;
    for call in 0..p.calls {
        let expected = model_call(&p, &mut acts, &draws, &mut accounts);
        clock.clear_sleeps();
        let mut request = text("x");
        if let Some(deadline) = p.deadline {
            request.set_timeout(deadline);
        }
        if let Some(over) = p.over {
            request.extensions_mut().insert(over.of());
        }
        let (record, code) = match say(service.clone(), request).await {
            Ok(answer) => (RetryRecord::of(&answer), None),
            Err(status) => (RetryRecord::of_status(&status), Some(status.code())),
        };
        let record = record.unwrap_or_else(|| panic!("{why}: call {call} has no record"));
        let got = Expected {
            attempts: record.attempts(),
            stop: record.stop_reason(),
            code,
            waits: clock.sleeps(),
        };
        assert_eq!(got, expected, "{why}: call {call}");
        // Every attempt told the server which it is, what is left, and the call's one key.
        let seen = script.seen();
        let heads = &seen[arrivals..];
        assert_eq!(
            heads.len(),
            expected.attempts as usize,
            "{why}: call {call}'s arrivals"
        );
        let mut left = p.deadline();
        for (n, head) in heads.iter().enumerate() {
            let previous = head
                .get("grpc-previous-rpc-attempts")
                .map(|v| v.to_str().unwrap().to_owned());
            assert_eq!(
                previous,
                (n > 0).then(|| n.to_string()),
                "{why}: call {call}"
            );
            if let Some(left) = left {
                let value = head.get("grpc-timeout").expect("the call's deadline");
                let told = parse_timeout(value.to_str().unwrap());
                assert!(
                    told <= left && left - told < Duration::from_millis(1),
                    "{why}: {told:?} of {left:?}"
                );
            }
            if n < expected.waits.len() {
                left = left.map(|l| l - expected.waits[n]);
            }
        }
        let keys: Vec<_> = heads
            .iter()
            .map(|h| h.get("idempotency-key").cloned())
            .collect();
        assert!(
            keys.iter().all(|k| k.is_some() == p.keyed && *k == keys[0]),
            "{why}: {keys:?}"
        );
        if p.keyed {
            assert_eq!(record.idempotency_key(), keys[0].as_ref(), "{why}");
        }
        arrivals += heads.len();
    }
    if let (Some(throttling), Some((t, _, _))) = (throttling, accounts.throttling) {
        assert_eq!(
            (throttling.tokens() * 1000.0).round() as i64,
            t,
            "{why}: tokens"
        );
    }
    if let (Some(budget), Some((t, _))) = (budget, accounts.budget) {
        assert_eq!(
            (budget.balance() * 1000.0).round() as i64,
            t,
            "{why}: the budget's tokens"
        );
    }
}

/// A `grpc-timeout` value, as the server read it.
fn parse_timeout(value: &str) -> Duration {
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().unwrap();
    match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        _ => Duration::from_nanos(n),
    }
}

#[tokio::test]
async fn random_calls_go_as_the_reference_model_of_a6_says() {
    let from: u64 = std::env::var("GRPC_SEED").map_or(0, |s| s.parse().unwrap());
    let scripts: u64 = std::env::var("GRPC_SCRIPTS").map_or(SCRIPTS, |s| s.parse().unwrap());
    for seed in from..from + scripts {
        run(seed).await;
    }
}
