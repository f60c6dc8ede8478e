//! An HTTP/2 server (cleartext, prior knowledge) whose streams follow a script, built on the
//! `h2` crate so that each protocol answer is exactly what the test asks for.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use h2::Reason;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the server does with stream `n` (0-based, over all connections).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum H2 {
    /// Processes the request and answers this status with body `ok`.
    Answer(u16),
    /// Resets the stream with REFUSED_STREAM without processing it (RFC 9113 §8.7).
    Refuse,
    /// Sends a graceful GOAWAY whose last stream id is below this stream's, so the stream is
    /// not processed, and closes the connection. Only as a connection's first stream.
    GoAway,
    /// Sends a graceful GOAWAY with last stream id 0 as soon as the connection opens, before
    /// any stream (counted as this stream's turn, received or not), and closes the
    /// connection: nothing is processed.
    GoAwayAtOnce,
    /// Processes the request, sends `200` and half a body, then resets the stream with
    /// INTERNAL_ERROR.
    ResetMidBody,
    /// Processes the request, sends `200` and half a body, then drops the connection.
    DropMidBody,
}

/// The scripted HTTP/2 server.
pub struct H2Server {
    pub addr: SocketAddr,
    streams: Arc<AtomicUsize>,
    processed: Arc<AtomicUsize>,
}

impl H2Server {
    pub async fn start(script: Vec<H2>) -> H2Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = H2Server {
            addr: listener.local_addr().unwrap(),
            streams: Arc::default(),
            processed: Arc::default(),
        };
        let (streams, processed) = (server.streams.clone(), server.processed.clone());
        let script = Arc::new(script);
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (streams, processed, script) =
                    (streams.clone(), processed.clone(), script.clone());
                tokio::spawn(async move {
                    let next = streams.load(Ordering::SeqCst);
                    match script[next.min(script.len() - 1)] {
                        H2::GoAway => return go_away_before_processing(tcp, &streams).await,
                        H2::GoAwayAtOnce => return go_away_at_once(tcp, &streams).await,
                        _ => {}
                    }
                    let Ok(mut connection) = h2::server::handshake(tcp).await else {
                        return;
                    };
                    while let Some(Ok((request, mut respond))) = connection.accept().await {
                        let n = streams.fetch_add(1, Ordering::SeqCst);
                        let action = script[n.min(script.len() - 1)];
                        // Read the whole request body, as a server that acts on it would.
                        let mut body = request.into_body();
                        while let Some(Ok(chunk)) = body.data().await {
                            let _ = body.flow_control().release_capacity(chunk.len());
                        }
                        match action {
                            H2::Answer(status) => {
                                processed.fetch_add(1, Ordering::SeqCst);
                                let head =
                                    http::Response::builder().status(status).body(()).unwrap();
                                if let Ok(mut send) = respond.send_response(head, false) {
                                    let _ = send.send_data(Bytes::from_static(b"ok"), true);
                                }
                            }
                            H2::Refuse => respond.send_reset(Reason::REFUSED_STREAM),
                            H2::GoAway | H2::GoAwayAtOnce => {
                                unreachable!("served before the handshake")
                            }
                            H2::ResetMidBody | H2::DropMidBody => {
                                processed.fetch_add(1, Ordering::SeqCst);
                                let head = http::Response::builder()
                                    .status(200)
                                    .header("content-length", "1000")
                                    .body(())
                                    .unwrap();
                                let Ok(mut send) = respond.send_response(head, false) else {
                                    continue;
                                };
                                let _ = send.send_data(Bytes::from(vec![b'x'; 500]), false);
                                if action == H2::ResetMidBody {
                                    // Let the half body leave before the reset.
                                    flush(&mut connection).await;
                                    send.send_reset(Reason::INTERNAL_ERROR);
                                    continue;
                                }
                                flush(&mut connection).await;
                                return;
                            }
                        }
                    }
                });
            }
        });
        server
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// Streams the server received, processed or not.
    pub fn streams(&self) -> usize {
        self.streams.load(Ordering::SeqCst)
    }

    /// Requests the server acted on.
    pub fn processed(&self) -> usize {
        self.processed.load(Ordering::SeqCst)
    }
}

/// Drives the connection for a moment, so frames queued on it are written.
async fn flush<T>(connection: &mut h2::server::Connection<T, Bytes>)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let _ = tokio::time::timeout(Duration::from_millis(20), connection.accept()).await;
}

/// Speaks just enough HTTP/2, frame by frame, to refuse a connection's first stream with a
/// graceful GOAWAY whose last stream id is 0: the server's preface, then, once the client's
/// HEADERS frame has arrived, GOAWAY(0, NO_ERROR), and the connection closes. The `h2` crate's
/// server counts a stream it has read as processed, so it cannot send this.
async fn go_away_before_processing(mut tcp: TcpStream, streams: &AtomicUsize) {
    const HEADERS: u8 = 0x1;
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;
    let frame = |kind: u8, flags: u8, payload: &[u8]| {
        let len = payload.len() as u32;
        let mut out = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            flags,
            0,
            0,
            0,
            0,
        ];
        out.extend_from_slice(payload);
        out
    };
    let mut preface = [0u8; 24];
    if tcp.read_exact(&mut preface).await.is_err() {
        return;
    }
    let _ = tcp.write_all(&frame(SETTINGS, 0, &[])).await;
    // Bounded: a client sends its SETTINGS, maybe a WINDOW_UPDATE, then HEADERS.
    for _ in 0..16 {
        let mut head = [0u8; 9];
        if tcp.read_exact(&mut head).await.is_err() {
            return;
        }
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        if tcp.read_exact(&mut payload).await.is_err() {
            return;
        }
        match head[3] {
            SETTINGS if head[4] & 0x1 == 0 => {
                let _ = tcp.write_all(&frame(SETTINGS, 0x1, &[])).await;
            }
            HEADERS => {
                streams.fetch_add(1, Ordering::SeqCst);
                // Last stream id 0, error code NO_ERROR (0).
                let _ = tcp.write_all(&frame(GOAWAY, 0, &[0; 8])).await;
                let _ = tcp.flush().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                return;
            }
            _ => {}
        }
    }
}

/// A connection's first frames, written as it opens: the server's SETTINGS, then
/// GOAWAY(last stream 0, NO_ERROR), before any stream; then what the client sent is
/// read and dropped for a moment (closing with it unread would reset the connection) before
/// the connection closes.
async fn go_away_at_once(mut tcp: TcpStream, streams: &AtomicUsize) {
    streams.fetch_add(1, Ordering::SeqCst);
    // SETTINGS (empty), then GOAWAY with last stream id 0 and NO_ERROR, as the connection opens.
    let mut frames = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0];
    frames.extend_from_slice(&[0, 0, 8, 0x7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let _ = tcp.write_all(&frames).await;
    let _ = tcp.flush().await;
    let mut sink = [0u8; 1024];
    let drain = async { while tcp.read(&mut sink).await.is_ok_and(|n| n > 0) {} };
    let _ = tokio::time::timeout(Duration::from_millis(50), drain).await;
}

/// A client speaking HTTP/2 with prior knowledge; `own_retries`: reqwest's own retries of
/// protocol refusals, beneath any middleware, on (reqwest's default) or off.
pub fn h2_client(own_retries: bool) -> reqwest::Client {
    let mut builder = reqwest::Client::builder()
        .http2_prior_knowledge()
        .timeout(Duration::from_secs(5));
    if !own_retries {
        builder = builder.retry(reqwest::retry::never());
    }
    builder.build().expect("an HTTP/2 client")
}
