use std::time::Duration;

use super::*;

const MS: Duration = Duration::from_millis(1);

#[test]
fn the_policy_keeps_a6_s_rules() {
    let build = |b: GrpcHedgingPolicyBuilder| b.build().map_err(|e| e.to_string());
    let ok = build(
        GrpcHedgingPolicy::builder()
            .max_attempts(9)
            .hedging_delay(5 * MS)
            .non_fatal_codes([14, 10]),
    )
    .unwrap();
    assert_eq!(ok.max_attempts(), 5, "cut to A6's cap");
    assert_eq!(ok.hedging_delay(), 5 * MS);
    assert!(ok.is_non_fatal(14) && ok.is_non_fatal(10) && !ok.is_non_fatal(13));
    assert!(!ok.is_non_fatal(-1) && !ok.is_non_fatal(300));
    let raised = GrpcHedgingPolicy::builder()
        .max_attempts(9)
        .allow_attempts_above_five(7)
        .non_fatal_codes([14]);
    assert_eq!(build(raised).unwrap().max_attempts(), 7);
    let default = build(
        GrpcHedgingPolicy::builder()
            .max_attempts(2)
            .non_fatal_codes([14]),
    );
    assert_eq!(default.unwrap().hedging_delay(), Duration::ZERO);
    for (builder, says) in [
        (
            GrpcHedgingPolicy::builder().non_fatal_codes([14]),
            "maxAttempts is required",
        ),
        (
            GrpcHedgingPolicy::builder()
                .max_attempts(1)
                .non_fatal_codes([14]),
            "maxAttempts (1) must be at least 2",
        ),
        (
            GrpcHedgingPolicy::builder()
                .max_attempts(2)
                .non_fatal_codes([17]),
            "nonFatalStatusCodes: 17 is not a gRPC status code",
        ),
    ] {
        let err = build(builder).unwrap_err();
        assert!(
            err.contains(says) && err.contains("gRPC hedging policy"),
            "{err}"
        );
    }
    let (run, rules) = ok.to_policy();
    assert_eq!(run.max_attempts(), 5);
    assert_eq!((rules.codes, rules.hedge_delay), (ok.codes(), Some(5 * MS)));
    assert_eq!(run.deadline(), crate::engine::grpc::NO_DEADLINE);
}

#[test]
fn a_delay_longer_than_a_grpc_duration_is_refused_at_build() {
    let policy = |delay| {
        GrpcHedgingPolicy::builder()
            .max_attempts(2)
            .hedging_delay(delay)
            .non_fatal_codes([14])
            .build()
    };
    let err = policy(Duration::MAX).unwrap_err().to_string();
    assert!(
        err.contains("hedgingDelay") && err.contains("292 years"),
        "{err}"
    );
    assert!(policy(crate::engine::grpc::LONGEST).is_ok());
    let json = r#"{"methodConfig": [{"name": [{}], "hedgingPolicy": {"maxAttempts": 2,
        "hedgingDelay": "9223372036854775807s", "nonFatalStatusCodes": [14]}}]}"#;
    let err = crate::grpc::GrpcConfig::from_json(json)
        .unwrap_err()
        .to_string();
    assert!(err.contains("hedgingDelay"), "{err}");
}
