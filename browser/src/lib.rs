//! The scripted server the browser's tests send to, on loopback: each test names a script of
//! answers, and the server answers its requests in turn by it, allowing any origin (CORS), and
//! keeps what every request carried for the test to read back.
//!
//! - `/script/{id}?s=503,503,201&ra=2,,&d=0,0,0`: the n-th request (OPTIONS aside) to `{id}`
//!   is answered with the n-th status of `s` (the last one from there on), the n-th
//!   `Retry-After` of `ra` in seconds (none where empty), after the n-th delay of `d` in
//!   milliseconds. Its body says which request it was (`request 1`).
//! - `/seen/{id}`: one line for each request `{id}` got, in order: its method and its
//!   `Idempotency-Key` (`-` for none).
//! - `/closed`: the origin of a loopback port where nothing listens.
//!
//! Every answer allows any origin and shows `Retry-After` and `Idempotency-Key` to the page
//! (`Access-Control-Expose-Headers`: a page reads only the headers a cross-origin answer lists
//! there); a preflight (`OPTIONS`) allows any method and header, and is not counted.

#![cfg(not(target_arch = "wasm32"))]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// What each script's requests carried, in order: method and idempotency key.
type Seen = Arc<Mutex<HashMap<String, Vec<(Method, Option<String>)>>>>;

/// Serves the scripts on `listener` until the process ends.
pub async fn serve(listener: TcpListener) {
    let seen = Seen::default();
    // Bounded by the process: the server runs until the tests are done and it is killed.
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let seen = seen.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| answer(request, seen.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Starts the server on an ephemeral loopback port, and says where.
pub async fn start() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    tokio::spawn(serve(listener));
    Ok(address)
}

async fn answer(
    request: Request<Incoming>,
    seen: Seen,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut response = if request.method() == Method::OPTIONS {
        preflight()
    } else {
        routed(&request, &seen).await
    };
    let headers = response.headers_mut();
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_ORIGIN,
        HeaderValue::from_static("*"),
    );
    headers.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("retry-after, idempotency-key"),
    );
    Ok(response)
}

/// A preflight's answer: any method, any header.
fn preflight() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::default());
    *response.status_mut() = StatusCode::NO_CONTENT;
    let headers = response.headers_mut();
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE"),
    );
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static("*"),
    );
    response
}

async fn routed(request: &Request<Incoming>, seen: &Seen) -> Response<Full<Bytes>> {
    let path = request.uri().path();
    if let Some(id) = path.strip_prefix("/script/") {
        let key = request
            .headers()
            .get("idempotency-key")
            .and_then(|key| key.to_str().ok())
            .map(str::to_owned);
        let n = {
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            let requests = seen.entry(id.to_owned()).or_default();
            requests.push((request.method().clone(), key));
            requests.len()
        };
        let script = Script::of(request.uri().query().unwrap_or(""));
        return script.answer(n).await;
    }
    if let Some(id) = path.strip_prefix("/seen/") {
        let seen = seen.lock().unwrap_or_else(|e| e.into_inner());
        let lines: String = seen
            .get(id)
            .into_iter()
            .flatten()
            .map(|(method, key)| format!("{method} {}\n", key.as_deref().unwrap_or("-")))
            .collect();
        return text(StatusCode::OK, lines);
    }
    if path == "/closed" {
        return match closed_port() {
            Ok(port) => text(StatusCode::OK, format!("http://127.0.0.1:{port}")),
            Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
    }
    text(StatusCode::NOT_FOUND, format!("no such script: {path}"))
}

/// A loopback port that was free a moment ago, with nothing listening on it now.
fn closed_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

/// A test's script, from its query: statuses, `Retry-After` seconds and delays, one for each
/// request in turn, the last repeated.
#[derive(Debug, Default, PartialEq)]
struct Script {
    statuses: Vec<u16>,
    retry_after: Vec<Option<u64>>,
    delays: Vec<u64>,
}

impl Script {
    fn of(query: &str) -> Script {
        let mut script = Script::default();
        for (name, value) in query.split('&').filter_map(|pair| pair.split_once('=')) {
            let values = value.split(',');
            match name {
                "s" => script.statuses = values.filter_map(|v| v.parse().ok()).collect(),
                "ra" => script.retry_after = values.map(|v| v.parse().ok()).collect(),
                "d" => script.delays = values.filter_map(|v| v.parse().ok()).collect(),
                _ => {}
            }
        }
        script
    }

    /// The `n`-th request's answer (from 1).
    async fn answer(&self, n: usize) -> Response<Full<Bytes>> {
        let nth = |i: usize, len: usize| i.min(len.saturating_sub(1));
        let delay = self.delays.get(nth(n - 1, self.delays.len())).copied();
        if let Some(millis) = delay.filter(|&ms| ms > 0) {
            tokio::time::sleep(Duration::from_millis(millis)).await;
        }
        let status = self.statuses.get(nth(n - 1, self.statuses.len())).copied();
        let status = status
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::OK);
        let mut response = text(status, format!("request {n}"));
        let retry_after = self.retry_after.get(nth(n - 1, self.retry_after.len()));
        if let Some(seconds) = retry_after.copied().flatten() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_reads_its_statuses_waits_and_delays_by_position() {
        let script = Script::of("s=503,503,201&ra=2,,&d=0,10");
        assert_eq!(script.statuses, [503, 503, 201]);
        assert_eq!(script.retry_after, [Some(2), None, None]);
        assert_eq!(script.delays, [0, 10]);
        assert_eq!(Script::of(""), Script::default());
    }
}
