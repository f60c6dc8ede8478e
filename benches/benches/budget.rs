//! The budget's cost per operation, next to a `Mutex`-based bucket doing the same accounting.
//!
//! One operation is a withdrawal followed by a deposit (so the balance stays put and neither
//! side ever refuses). Figures are per pair; divide by two for one operation.
//!
//! Run with `cargo bench -p reqwest-safe-retry-benches --bench budget`.

use std::hint::black_box;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use reqwest_safe_retry::{RetryBudget, RetryKind};

/// The baseline: the same bucket behind a lock.
struct MutexBucket {
    balance: Mutex<u64>,
    capacity: u64,
}

impl MutexBucket {
    fn try_withdraw(&self, cost: u64) -> Option<u64> {
        let mut balance = self.balance.lock().unwrap();
        let left = balance.checked_sub(cost)?;
        *balance = left;
        Some(cost)
    }

    fn deposit(&self, amount: u64) {
        let mut balance = self.balance.lock().unwrap();
        *balance = balance.saturating_add(amount).min(self.capacity);
    }
}

fn budget() -> RetryBudget {
    // Floor off: the time floor's refill is measured on its own below.
    RetryBudget::builder()
        .capacity(1e9)
        .deposit_ratio(1.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap()
}

fn mutex_bucket() -> MutexBucket {
    MutexBucket {
        balance: Mutex::new(1_000_000_000_000),
        capacity: 1_000_000_000_000,
    }
}

fn uncontended(c: &mut Criterion) {
    let mut group = c.benchmark_group("budget/1 thread (withdraw + deposit)");
    let now = Instant::now();
    let lock_free = budget();
    group.bench_function("RetryBudget", |b| {
        b.iter(|| {
            black_box(lock_free.try_withdraw(black_box(RetryKind::Other), now));
            lock_free.deposit_first_attempt();
        })
    });
    let with_floor = RetryBudget::builder().capacity(1e9).build().unwrap();
    group.bench_function("RetryBudget with time floor", |b| {
        b.iter(|| {
            black_box(with_floor.try_withdraw(black_box(RetryKind::Other), Instant::now()));
            with_floor.deposit_first_attempt();
        })
    });
    let locked = mutex_bucket();
    group.bench_function("Mutex bucket", |b| {
        b.iter(|| {
            black_box(locked.try_withdraw(black_box(1000)));
            locked.deposit(1000);
        })
    });
    group.finish();
}

/// Runs `per_thread` operation pairs on each of two threads at once; returns the wall time.
fn two_threads(iters: u64, op: impl Fn() + Sync) -> Duration {
    let barrier = Barrier::new(2);
    let per_thread = iters.div_ceil(2);
    let op = &op;
    let barrier = &barrier;
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..per_thread {
                        op();
                    }
                    start.elapsed()
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap())
            .max()
            .unwrap_or_default()
    })
}

fn contended(c: &mut Criterion) {
    let mut group = c.benchmark_group("budget/2 threads (withdraw + deposit)");
    let now = Instant::now();
    let lock_free = Arc::new(budget());
    group.bench_function("RetryBudget", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, || {
                black_box(lock_free.try_withdraw(RetryKind::Other, now));
                lock_free.deposit_first_attempt();
            })
        })
    });
    let locked = Arc::new(mutex_bucket());
    group.bench_function("Mutex bucket", |b| {
        b.iter_custom(|iters| {
            two_threads(iters, || {
                black_box(locked.try_withdraw(1000));
                locked.deposit(1000);
            })
        })
    });
    group.finish();
}

criterion_group!(benches, uncontended, contended);
criterion_main!(benches);
