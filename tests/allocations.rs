//! Heap allocations per request on the success path: this crate's middleware against a
//! pass-through `reqwest-middleware` chain, counted by a global allocator.
//!
//! A binary of its own, because a global allocator counts for the whole binary. Client and
//! server share one current-thread runtime, so the server's allocations, the same for both
//! clients, cancel out in the difference.

#[path = "../benches/common/loopback.rs"]
mod loopback;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{RetryMiddleware, RetryPolicy};

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; counting has no effect on
// the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations per request over `n` POSTs with a small body, after a warm-up.
async fn per_request(client: &ClientWithMiddleware, url: &str, n: u64) -> f64 {
    for _ in 0..50 {
        client
            .post(url)
            .body("{\"id\":1}")
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
    }
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..n {
        let response = client.post(url).body("{\"id\":1}").send().await.unwrap();
        assert_eq!(response.bytes().await.unwrap().as_ref(), b"ok");
    }
    (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / n as f64
}

#[tokio::test(flavor = "current_thread")]
async fn the_success_path_allocates_only_what_retrying_through_reqwest_middleware_requires() {
    let addr = loopback::start(loopback::Mode::Ok).await;
    let url = format!("http://{addr}/orders");
    let client = |m: Option<Box<dyn FnOnce(ClientBuilder) -> ClientBuilder>>| {
        let builder = ClientBuilder::new(reqwest::Client::new());
        match m {
            Some(with) => with(builder).build(),
            None => builder.build(),
        }
    };
    let bare = client(None);
    let reqwest_retry = client(Some(Box::new(|b| {
        let policy =
            reqwest_retry::policies::ExponentialBackoff::builder().build_with_max_retries(2);
        b.with(reqwest_retry::RetryTransientMiddleware::new_with_policy(
            policy,
        ))
    })));
    let ours_unkeyed = client(Some(Box::new(|b| {
        b.with(RetryMiddleware::new(RetryPolicy::default()).without_idempotency_keys())
    })));
    let ours = client(Some(Box::new(|b| {
        b.with(RetryMiddleware::new(RetryPolicy::default()))
    })));

    const N: u64 = 2_000;
    let b = per_request(&bare, &url, N).await;
    let c = per_request(&reqwest_retry, &url, N).await;
    let d_unkeyed = per_request(&ours_unkeyed, &url, N).await;
    let d = per_request(&ours, &url, N).await;

    println!(
        "allocations per POST: (b) pass-through chain {b:.2}; (c) reqwest-retry {c:.2} ({:+.2}); \
         (d) this crate without keys {d_unkeyed:.2} ({:+.2}), with keys {d:.2} ({:+.2})",
        c - b,
        d_unkeyed - b,
        d - b
    );
    // Every retrying middleware pays for its boxed future and for the copy of the request it
    // keeps for a retry: reqwest-retry's count measures that. Beyond it, this crate adds the
    // RetryRecord on the response (1), and the mark that tells nested instances this request is
    // already being retried (2: the request's extension map and its table, made on first use)...
    assert!(d_unkeyed - c <= 3.0, "{d_unkeyed:.2} vs {c:.2}");
    // ...and the idempotency key: its value, and room for it in the request's header map.
    assert!(d - d_unkeyed <= 3.0, "{d:.2} vs {d_unkeyed:.2}");
}
