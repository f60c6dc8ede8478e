//! Crash recovery with real processes: the charges example killed with SIGKILL at each
//! recovery point in turn, and a new process on the same database (with the reconciler and the
//! relay) finishing every request. The walk-through is the example's own
//! (`cargo run -p safe-retry-server --example charges -- --walkthrough`).

use crate::walkthrough::{AFTER_DELIVERY, Walked, example_binary, walk_all};

fn check(walked: &[Walked]) {
    assert_eq!(walked.len(), 6, "{walked:#?}");
    for w in walked {
        assert_eq!(w.charges, 1, "one charge: {w:?}");
        assert_eq!(w.receipts, 1, "one receipt: {w:?}");
        assert_eq!(w.order_rows, 1, "one order row: {w:?}");
        assert_eq!(w.outbox.0, "sent", "{w:?}");
        assert!(w.answers_identical, "{w:?}");
        // What finished each: nothing was saved for a resumption before the order, so only the
        // client's retry can; after the delivery the answer was stored, and only the relay had
        // work left; in between, the reconciler resumed the record at its recovery point.
        let finisher = match w.point {
            "before-order" => "a retry",
            AFTER_DELIVERY => "the relay",
            _ => "the reconciler",
        };
        assert_eq!(w.finished_by, finisher, "{w:?}");
        match w.point {
            // The charge was made before the kill, and made again, under its key, after.
            "after-charge-call" => assert_eq!(w.charge_calls, 2, "{w:?}"),
            // The receipt was delivered before the kill, and again, under its key, after.
            AFTER_DELIVERY => {
                assert_eq!((w.receipt_calls, w.outbox.1), (2, 2), "{w:?}")
            }
            _ => assert_eq!((w.charge_calls, w.receipt_calls), (1, 1), "{w:?}"),
        }
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_sigkill_at_each_recovery_point_leaves_one_effect_each() {
    let dir = std::env::temp_dir().join(format!("safe-retry-crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let walked = walk_all(&example_binary(), |point| {
        format!("sqlite://{}", dir.join(format!("{point}.db")).display())
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    check(&walked);
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sigkill_at_each_recovery_point_leaves_one_effect_each() {
    // A schema per point, made (and dropped when this run has ended) as every test's is.
    let mut urls = std::collections::HashMap::new();
    for point in crate::orders_app::POINTS
        .into_iter()
        .chain([AFTER_DELIVERY])
    {
        urls.insert(point, crate::support::postgres::fresh_url().await);
    }
    let walked = walk_all(&example_binary(), |point| urls[point].clone()).await;
    check(&walked);
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_sigkill_at_each_recovery_point_leaves_one_effect_each() {
    // A database per point, made (and dropped when this run has ended) as every test's is.
    let mut urls = std::collections::HashMap::new();
    for point in crate::orders_app::POINTS
        .into_iter()
        .chain([AFTER_DELIVERY])
    {
        urls.insert(point, crate::support::mysql::fresh_url().await);
    }
    let walked = walk_all(&example_binary(), |point| urls[point].clone()).await;
    check(&walked);
}
