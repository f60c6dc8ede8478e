//! The scripted server answers as the browser's tests count on: its scripts in turn, every
//! request's key kept, and CORS that lets a page of another origin send them and read
//! `Retry-After`.

#![cfg(not(target_arch = "wasm32"))]

#[tokio::test]
async fn the_server_answers_by_its_script_and_keeps_every_request_s_key() {
    let origin = format!("http://{}", browser_tests::start().await.unwrap());
    let client = reqwest::Client::new();
    let script = format!("{origin}/script/native?s=503,201&ra=2,");

    let preflight = client
        .request(reqwest::Method::OPTIONS, &script)
        .header("origin", "http://127.0.0.1:1")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "idempotency-key")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 204);
    let allowed = |name: &str| preflight.headers()[name].to_str().unwrap().to_owned();
    assert_eq!(allowed("access-control-allow-origin"), "*");
    assert_eq!(allowed("access-control-allow-headers"), "*");
    assert!(allowed("access-control-allow-methods").contains("POST"));

    let first = client
        .post(&script)
        .header("idempotency-key", "k-1")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 503);
    assert_eq!(first.headers()["retry-after"], "2");
    let exposed = first.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap();
    assert!(exposed.contains("retry-after"), "{exposed}");
    let second = client.post(&script).send().await.unwrap();
    assert_eq!(second.status(), 201);
    assert!(second.headers().get("retry-after").is_none());
    assert_eq!(second.text().await.unwrap(), "request 2");
    // The last status holds from there on.
    let third = client.get(&script).send().await.unwrap();
    assert_eq!(third.status(), 201);

    let seen = client
        .get(format!("{origin}/seen/native"))
        .send()
        .await
        .unwrap();
    assert_eq!(seen.text().await.unwrap(), "POST k-1\nPOST -\nGET -\n");

    let closed = client.get(format!("{origin}/closed")).send().await.unwrap();
    let closed = closed.text().await.unwrap();
    let refused = client.get(&closed).send().await.unwrap_err();
    assert!(refused.is_connect(), "{closed}: {refused:?}");
}
