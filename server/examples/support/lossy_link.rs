//! A TCP link on loopback that loses connections by a seeded draw: the flaky network between
//! the two halves, for the `both_halves` example and the server's tests.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the link does to one connection (the client opens one per attempt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Resets the connection once the request arrived, before the server sees it.
    ResetBefore,
    /// Passes the request, then resets the connection when the answer starts to come back:
    /// the server did the work, the client never hears of it. Over HTTP/2 the answer starts
    /// with the server's first `HEADERS` frame (its settings and window updates pass).
    DropAnswer,
    /// Passes the request, then resets the connection after a few milliseconds, whatever the
    /// server is doing by then.
    CutSoon,
    /// Passes everything.
    Pass,
}

/// A TCP link on loopback between the client and the server that misbehaves by a seeded
/// draw per connection.
pub struct LossyLink {
    /// Where the client connects.
    pub addr: SocketAddr,
    /// The fate drawn for each connection so far, in order.
    pub fates: Arc<Mutex<Vec<Fate>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for LossyLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// xorshift64*: a small seeded generator, so a failing seed replays the same link.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

impl LossyLink {
    /// Starts a link on loopback to `upstream`; `seed` fixes its draws.
    pub async fn start(upstream: SocketAddr, seed: u64) -> LossyLink {
        LossyLink::start_to(Arc::new(Mutex::new(vec![upstream])), seed).await
    }

    /// Starts a link on loopback to a fleet: each connection goes to the next of `upstreams`
    /// in turn, as the list stands when it arrives (a connection while the list is empty is
    /// reset).
    pub async fn start_to(upstreams: Arc<Mutex<Vec<SocketAddr>>>, seed: u64) -> LossyLink {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fates = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let fates = fates.clone();
            async move {
                let mut state = seed | 1;
                let mut turn = 0usize;
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        return;
                    };
                    let upstream = {
                        let upstreams = upstreams.lock().unwrap();
                        turn = turn.wrapping_add(1);
                        (!upstreams.is_empty()).then(|| upstreams[turn % upstreams.len()])
                    };
                    let Some(upstream) = upstream else {
                        reset(client).await;
                        continue;
                    };
                    let fate = match next(&mut state) % 10 {
                        0 | 1 => Fate::ResetBefore,
                        2 | 3 => Fate::DropAnswer,
                        4 => Fate::CutSoon,
                        _ => Fate::Pass,
                    };
                    let cut_after = Duration::from_millis(next(&mut state) % 30);
                    fates.lock().unwrap().push(fate);
                    tokio::spawn(carry(client, upstream, fate, cut_after));
                }
            }
        });
        LossyLink { addr, fates, task }
    }
}

async fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

async fn carry(mut client: TcpStream, upstream: SocketAddr, fate: Fate, cut_after: Duration) {
    let mut first = vec![0u8; 64 * 1024];
    let Ok(n) = client.read(&mut first).await else {
        return;
    };
    if n == 0 {
        return;
    }
    if fate == Fate::ResetBefore {
        return reset(client).await;
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    if server.write_all(&first[..n]).await.is_err() {
        return;
    }
    match fate {
        Fate::DropAnswer if first[..n].starts_with(H2_PREFACE) => {
            drop_h2_answer(client, server).await;
        }
        Fate::DropAnswer => {
            // Carry the rest of the request; reset both sides at the answer's first byte.
            let mut buf = vec![0u8; 64 * 1024];
            let mut answer = [0u8; 1];
            loop {
                tokio::select! {
                    read = client.read(&mut buf) => match read {
                        Ok(0) | Err(_) => return,
                        Ok(n) => if server.write_all(&buf[..n]).await.is_err() { return },
                    },
                    read = server.read(&mut answer) => {
                        let _ = read;
                        reset(server).await;
                        return reset(client).await;
                    }
                }
            }
        }
        Fate::CutSoon => {
            let _ = tokio::time::timeout(
                cut_after,
                tokio::io::copy_bidirectional(&mut client, &mut server),
            )
            .await;
            reset(server).await;
            reset(client).await;
        }
        Fate::Pass | Fate::ResetBefore => {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        }
    }
}

/// What an HTTP/2 client sends first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Carries an HTTP/2 connection both ways, frame by frame from the server, and resets both
/// sides when the server's first `HEADERS` frame (an answer's head) arrives.
async fn drop_h2_answer(mut client: TcpStream, mut server: TcpStream) {
    const HEADERS: u8 = 0x1;
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    loop {
        tokio::select! {
            read = client.read(&mut up) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => if server.write_all(&up[..n]).await.is_err() { return },
            },
            read = server.read(&mut down) => {
                let n = match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                pending.extend_from_slice(&down[..n]);
                // Whole frames: a 9-byte head (length 3, type 1, flags 1, stream 4), then the
                // payload.
                while pending.len() >= 9 {
                    let len = usize::from(pending[0]) << 16
                        | usize::from(pending[1]) << 8
                        | usize::from(pending[2]);
                    if pending[3] == HEADERS {
                        reset(server).await;
                        return reset(client).await;
                    }
                    if pending.len() < 9 + len {
                        break;
                    }
                    let frame: Vec<u8> = pending.drain(..9 + len).collect();
                    if client.write_all(&frame).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}
