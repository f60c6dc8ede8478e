//! Loopback peers for the protocol tests: a TLS server with a certificate generated per run,
//! and an HTTP/2 server whose every stream follows a script (answer, refuse, reset, go away).
//! Nothing here leaves 127.0.0.1.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[cfg(feature = "http2")]
pub mod h2_server;

/// A certificate for `localhost` and `127.0.0.1`, made for this run, with its key.
pub struct Identity {
    pub cert: rustls::pki_types::CertificateDer<'static>,
    pub key: rustls::pki_types::PrivateKeyDer<'static>,
}

impl Identity {
    pub fn generate() -> Identity {
        let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        let certified = rcgen::generate_simple_self_signed(names).expect("a certificate");
        Identity {
            cert: certified.cert.der().clone(),
            key: rustls::pki_types::PrivateKeyDer::Pkcs8(
                certified.signing_key.serialize_der().into(),
            ),
        }
    }
}

/// Installs the crypto provider rustls needs, once per process.
pub fn install_crypto() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

/// What the TLS server does with connection `n` (0-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tls {
    /// Completes the handshake and answers `200 OK` with body `ok`.
    Answer,
    /// Reads the client's first bytes (its hello), then resets the connection mid-handshake.
    ResetInHandshake,
}

/// A TLS server on 127.0.0.1: connection `n` gets `script[n]`, or the last entry.
pub struct TlsServer {
    pub addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    handshakes: Arc<AtomicUsize>,
}

impl TlsServer {
    pub async fn start(identity: &Identity, script: Vec<Tls>) -> TlsServer {
        install_crypto();
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![identity.cert.clone()], identity.key.clone_key())
            .expect("a server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = TlsServer {
            addr: listener.local_addr().unwrap(),
            connections: Arc::default(),
            handshakes: Arc::default(),
        };
        let (connections, handshakes) = (server.connections.clone(), server.handshakes.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut tcp, _)) = listener.accept().await else {
                    return;
                };
                let n = connections.fetch_add(1, Ordering::SeqCst);
                let action = script[n.min(script.len() - 1)];
                let (acceptor, handshakes) = (acceptor.clone(), handshakes.clone());
                tokio::spawn(async move {
                    if action == Tls::ResetInHandshake {
                        let mut hello = [0u8; 64];
                        let _ = tcp.read(&mut hello).await;
                        reset(tcp);
                        return;
                    }
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    handshakes.fetch_add(1, Ordering::SeqCst);
                    let mut buf = vec![0u8; 4096];
                    let mut head = Vec::new();
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
                    let _ = tls.write_all(ok).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        server
    }

    pub fn url(&self) -> String {
        format!("https://localhost:{}/", self.addr.port())
    }

    /// TCP connections accepted.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// TLS handshakes completed.
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }
}

/// A reqwest client that trusts `roots` only, resolving `localhost` to 127.0.0.1.
#[cfg(feature = "tls")]
pub fn tls_client(roots: &[rustls::pki_types::CertificateDer<'static>]) -> reqwest::Client {
    install_crypto();
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store.add(root.clone()).expect("a root certificate");
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(store)
        .with_no_client_auth();
    reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .resolve("localhost", SocketAddr::from(([127, 0, 0, 1], 0)))
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("a TLS client")
}

/// Resets `stream`: RST instead of an orderly close.
pub fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}
