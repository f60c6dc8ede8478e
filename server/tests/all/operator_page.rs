//! The operator's page in a real browser: headless Chromium (Debian's `chromium` and
//! `chromium-driver`, driven over WebDriver) opens the page the charges example serves, sees
//! the record a scripted crash left parked after its charge call, retries it, and sees it
//! completed; the order is then answered from the record, charged once.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::processes::Charges;

use crate::receiver::Receiver;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A WebDriver session on a chromedriver of its own, over its HTTP protocol.
struct Browser {
    driver: Child,
    http: reqwest::Client,
    session: String,
}

impl Browser {
    async fn open() -> Browser {
        for needed in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(needed).exists(),
                "{needed} is missing: the browser test needs Debian's Chromium and ChromeDriver \
                 (apt-get install chromium chromium-driver; .ci/run installs them)"
            );
        }
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver starts");
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let mut ready = false;
        for _ in 0..200 {
            if let Ok(answer) = http.get(format!("{base}/status")).send().await
                && answer.status().is_success()
            {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(ready, "chromedriver did not answer within 5 s");
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1500,700"]
            }
        }}});
        let created = send(http.post(format!("{base}/session")), &capabilities).await;
        let session = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {created}"))
            .to_owned();
        Browser {
            driver,
            http,
            session: format!("{base}/session/{session}"),
        }
    }

    async fn command(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let request = self.http.request(method, format!("{}{path}", self.session));
        let answer = send(request, &body).await;
        assert!(answer["value"].get("error").is_none(), "{path}: {answer}");
        answer["value"].clone()
    }

    /// The text of `css` once it reads `expected` (the page may be loading the form's answer:
    /// an element of the page before is stale), within 10 s.
    async fn text_becomes(&self, css: &str, expected: &str) {
        let mut last = String::new();
        for _ in 0..200 {
            let request = self.http.post(format!("{}/element", self.session));
            let found = send(request, &json!({"using": "css selector", "value": css})).await;
            if let Some(element) = found["value"]["element-6066-11e4-a52e-4f735466cecf"].as_str() {
                let request = self
                    .http
                    .get(format!("{}/element/{element}/text", self.session));
                let text = send(request, &Value::Null).await;
                if let Some(text) = text["value"].as_str() {
                    if text.contains(expected) {
                        return;
                    }
                    last = text.to_owned();
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{css} still reads {last:?}, not {expected:?}, after 10 s");
    }

    async fn go(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await;
    }

    async fn find(&self, css: &str) -> String {
        let found = self
            .command(
                reqwest::Method::POST,
                "/element",
                json!({"using": "css selector", "value": css}),
            )
            .await;
        found["element-6066-11e4-a52e-4f735466cecf"]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_owned()
    }

    async fn text(&self, css: &str) -> String {
        let element = self.find(css).await;
        let text = self
            .command(
                reqwest::Method::GET,
                &format!("/element/{element}/text"),
                Value::Null,
            )
            .await;
        text.as_str().unwrap_or_default().to_owned()
    }

    async fn click(&self, css: &str) {
        let element = self.find(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{element}/click"),
            json!({}),
        )
        .await;
    }

    async fn screenshot(&self, to: &Path) {
        let png = self
            .command(reqwest::Method::GET, "/screenshot", Value::Null)
            .await;
        std::fs::write(to, base64(png.as_str().unwrap())).unwrap();
    }

    async fn close(mut self) {
        let _ = self.http.delete(&self.session).send().await;
        let _ = self.driver.kill().await;
    }
}

/// A WebDriver command's JSON sent, its JSON answer read.
async fn send(request: reqwest::RequestBuilder, body: &Value) -> Value {
    let request = match body {
        Value::Null => request,
        body => request
            .header("content-type", "application/json")
            .body(body.to_string()),
    };
    let answer = request.send().await.unwrap().bytes().await.unwrap();
    serde_json::from_slice(&answer).unwrap()
}

/// Standard base64 decoded (WebDriver's screenshots).
fn base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let clean: Vec<u8> = text
        .bytes()
        .filter(|c| *c != b'=' && !c.is_ascii_whitespace())
        .collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= u32::from(value(*c)) << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_retries_a_parked_order_from_the_page_in_a_browser() {
    let dir = std::env::temp_dir().join(format!("safe-retry-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let database = format!("sqlite://{}", dir.join("orders.db").display());
    let (payments_addr, payments) = Receiver::start("ch").await;
    let (receipts_addr, _receipts) = Receiver::start("rc").await;
    let args = |crash: bool| {
        let mut args: Vec<String> = [
            "--addr",
            "127.0.0.1:0",
            "--ops-addr",
            "127.0.0.1:0",
            "--database-url",
            &database,
            "--payments-url",
            &format!("http://{payments_addr}"),
            "--receipts-url",
            &format!("http://{receipts_addr}"),
            // Long enough that the second process's first reconciler tick, at its start, finds
            // the dead holder's lease still running (and leaves the record to the operator).
            "--lease-ms",
            "2500",
            "--header-read-timeout-ms",
            "300",
            // The reconciler runs when the operator says, not on its own.
            "--every-ms",
            "3600000",
        ]
        .map(str::to_owned)
        .to_vec();
        if crash {
            args.extend(["--crash-at".to_owned(), "after-charge-call".to_owned()]);
        }
        args
    };
    let client = reqwest::Client::new();
    let order = |addr: String| {
        let client = client.clone();
        async move {
            client
                .post(format!("http://{addr}/orders"))
                .header("idempotency-key", "page-1")
                .body(r#"{"item":"book"}"#)
                .send()
                .await
        }
    };

    // A process charges the order, then dies before it records the charge.
    let mut first = Charges::start(&args(true)).await;
    let sent = tokio::spawn(order(first.addr.clone()));
    first.line("reached after-charge-call").await;
    first.child.kill().await.unwrap();
    let _ = sent.await;
    assert_eq!(payments.effects().len(), 1, "charged once before the crash");

    let mut second = Charges::start(&args(false)).await;
    let ops = second.line("operator's view on http://").await;
    let ops = ops
        .strip_prefix("operator's view on ")
        .and_then(|rest| rest.split(',').next())
        .unwrap()
        .to_owned();
    // Past the dead holder's lease, the record is parked at its recovery point.
    let parked = async {
        loop {
            let tally = client
                .get(format!("{ops}/api/tally"))
                .send()
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap();
            let tally: Value = serde_json::from_slice(&tally).unwrap();
            if tally["parked"] == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), parked)
        .await
        .expect("the record is parked once the dead holder's lease ends");

    let browser = Browser::open().await;
    browser.go(&ops).await;
    assert_eq!(browser.text("#tally-parked").await, "parked: 1");
    let row = "#parked tr[data-key=\"page-1\"]";
    let shown = browser.text(row).await;
    assert!(shown.contains("charge:started"), "{shown}");
    assert!(shown.contains("POST /orders"), "{shown}");
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("operator-page.png");
    browser.screenshot(&shot).await;
    assert!(std::fs::read(&shot).unwrap().starts_with(b"\x89PNG"));
    browser.click(&format!("{row} button.retry")).await;
    // The form's answer sends the browser back to the page, now read after the retry.
    browser
        .text_becomes("#tally-completed", "completed: 1")
        .await;
    assert_eq!(browser.text("#tally-parked").await, "parked: 0");
    assert!(browser.text("#parked").await.contains("none"));
    browser.close().await;

    // The example as a service: its counters and the record gauges on /metrics, and a client
    // that sends its headers a byte at a time is cut off after the header read timeout.
    let metrics = client
        .get(ops.replace("/ops", "/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("safe_retry_server_claims_total"),
        "{metrics}"
    );
    assert!(
        metrics.contains("safe_retry_server_records{standing=\"parked\"}"),
        "{metrics}"
    );
    let dripped = tokio::time::timeout(Duration::from_secs(5), async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut slow = tokio::net::TcpStream::connect(&second.addr).await.unwrap();
        for byte in b"POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: slow\r\n" {
            if slow.write_all(&[*byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest).await;
    });
    dripped
        .await
        .expect("a connection dripping its headers is cut off, not held");

    // The order's answer is the record's: one charge, made under one key.
    let answer = order(second.addr.clone()).await.unwrap();
    assert_eq!(answer.status(), 201);
    assert!(answer.headers().contains_key("idempotent-replayed"));
    assert_eq!(payments.effects().len(), 1, "one charge");
    second.child.kill().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    println!("the page as the operator saw it: {}", shot.display());
}
