//! The browser tests' scripted server (`browser_tests::serve`): starts on an ephemeral
//! loopback port, prints its origin (`http://127.0.0.1:PORT`) on the first line, and serves
//! until it is killed. `.ci/browser` starts it before the tests and builds them with that
//! origin in `SAFE_RETRY_BROWSER_SERVER`.

#[cfg(not(target_arch = "wasm32"))]
#[tokio::main]
async fn main() -> std::io::Result<()> {
    use std::io::Write as _;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "http://{address}")?;
    out.flush()?;
    drop(out);
    browser_tests::serve(listener).await;
    Ok(())
}

/// Nothing to serve from inside a page.
#[cfg(target_arch = "wasm32")]
fn main() {}
