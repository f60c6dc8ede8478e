//! A small keep-alive HTTP/1.1 server on 127.0.0.1 for the overhead bench and the allocation
//! test: as little work per request as a server can do, so the client's cost stands out.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How the server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `200 OK` to everything.
    Ok,
    /// `503` and `200` in turn, server-wide: with one request at a time, every logical request
    /// meets one 503 and then a 200.
    #[allow(dead_code, reason = "the allocation test uses only `Ok`")]
    FailThenOk,
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
const UNAVAILABLE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n";

/// Starts the server on the current runtime; returns its address.
pub async fn start(mode: Mode) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(serve(stream, mode, served.clone()));
        }
    });
    addr
}

async fn serve(mut stream: TcpStream, mode: Mode, served: Arc<AtomicU64>) {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        // Read one request: the head, then its content-length body.
        let (head_end, body_len) = loop {
            if let Some(end) = find(&buf, b"\r\n\r\n") {
                break (end + 4, content_length(&buf[..end]));
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        while buf.len() < head_end + body_len {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..head_end + body_len);
        let n = served.fetch_add(1, Ordering::Relaxed);
        let answer = match mode {
            Mode::FailThenOk if n % 2 == 0 => UNAVAILABLE,
            _ => OK,
        };
        if stream.write_all(answer).await.is_err() {
            return;
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn content_length(head: &[u8]) -> usize {
    let head = std::str::from_utf8(head).unwrap_or("");
    head.lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(0)
}
