//! What a retried response costs in bytes moved and memory held, with `buffer_body` on: its
//! body is dropped, never read in full. A binary of its own, because a global allocator that
//! tracks the peak of live bytes counts for the whole binary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{FakeClock, RetryMiddleware, RetryPolicy, RetryRecord};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

struct Tracking;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded unchanged to the system allocator; tracking sizes has no
// effect on the memory handed out.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        grew(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

const BODY: u64 = 100_000_000;
const MB: f64 = 1_000_000.0;

/// Answers the first two connections with a 503 whose body is 100 MB of zeros, written for as
/// long as the client takes it, and the third with a small 200. Returns its address and, per
/// 503, the bytes of body it managed to hand to the socket.
async fn server() -> (std::net::SocketAddr, Arc<[AtomicU64; 3]>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // The bytes each 503's writer sent, and how many writers have finished.
    let sent: Arc<[AtomicU64; 3]> =
        Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let counts = sent.clone();
    tokio::spawn(async move {
        for n in 0..3 {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let read = stream.read(&mut buf).await.unwrap();
                assert!(read > 0, "the client closed before sending its request");
                head.extend_from_slice(&buf[..read]);
            }
            if n == 2 {
                let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
                stream.write_all(ok).await.unwrap();
                continue;
            }
            let counts = counts.clone();
            tokio::spawn(async move {
                let head = format!(
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-length: {BODY}\r\n\
                     connection: close\r\n\r\n"
                );
                stream.write_all(head.as_bytes()).await.unwrap();
                let chunk = vec![0u8; 64 * 1024];
                let mut written = 0u64;
                // Bounded by the body's length; ends early when the client hangs up.
                while written < BODY {
                    if stream.write_all(&chunk).await.is_err() {
                        break;
                    }
                    written += chunk.len() as u64;
                    counts[n].store(written, Ordering::SeqCst);
                }
                counts[2].fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    (addr, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_response_s_body_is_dropped_not_buffered() {
    let (addr, sent) = server().await;
    let policy = RetryPolicy::builder()
        .buffer_body(256 * 1024 * 1024)
        .build()
        .unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy).with_clock(FakeClock::new()))
        .build();

    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let response = client.get(format!("http://{addr}/")).send().await.unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - before;

    assert_eq!(response.status(), 200);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 3);
    assert_eq!(response.text().await.unwrap(), "ok");
    // Wait until both writers have seen the hang-up and stopped counting (bounded: 5 s).
    for _ in 0..500 {
        if sent[2].load(Ordering::SeqCst) == 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(sent[2].load(Ordering::SeqCst), 2, "both writers finished");
    let moved: Vec<u64> = sent[..2].iter().map(|n| n.load(Ordering::SeqCst)).collect();
    println!(
        "per 503 with a 100 MB body: {:.1} MB and {:.1} MB reached the socket; \
         peak memory during the request {:.2} MB",
        moved[0] as f64 / MB,
        moved[1] as f64 / MB,
        peak as f64 / MB
    );
    // What the kernel's socket buffers take before the client hangs up, not the body.
    for bytes in moved {
        assert!(
            bytes < 16_000_000,
            "{bytes} bytes of a retried body were sent"
        );
    }
    assert!(peak < 8_000_000, "{peak} bytes held at the peak");
}
