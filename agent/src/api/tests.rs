//! The router end to end, in process: limits, error shapes, cluster
//! questions without peers, empty windows, the tuning body's numbers.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use tower::ServiceExt;

use super::*;
use crate::timeline::RecordedTrace;

/// A router over a recorded trace of `events` thread-state slices.
fn app(events: usize, limits: TimelineLimits) -> Router {
    let trace: Vec<Value> = (0..events)
        .map(|i| {
            json!({"ph": "X", "cat": "thread_state", "name": "running",
            "pid": 1, "tid": 1, "ts": i as f64, "dur": 0.5})
        })
        .collect();
    let state = ApiState {
        cluster: crate::cluster::Cluster::new(crate::cluster::ClusterConfig {
            node_name: "test-node".into(),
            peers: Vec::new(),
            peers_dns: None,
            timeout: std::time::Duration::from_secs(1),
            max_timeline_bytes: 1 << 20,
        }),
        load_feed: None,
        gpus: Gpus::shared(),
        started: Instant::now(),
        recorded: Some(Arc::new(
            RecordedTrace::from_events(trace, None, "test").expect("a trace"),
        )),
        timeline_event_limit: 1_000_000,
        live: Arc::new(Mutex::new(None)),
        jobs: None,
        tunings: None,
        nccl: None,
        auth: Arc::new(Auth {
            token: None,
            loopback_only: true,
        }),
    };
    router_with(state, limits)
}

async fn send(app: &Router, method: &str, uri: &str, body: Body) -> Response {
    let request = axum::http::Request::builder()
        .method(method)
        .uri(uri)
        .body(body)
        .expect("a request");
    app.clone().oneshot(request).await.expect("infallible")
}

async fn json_of(response: Response) -> Value {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("a body");
    serde_json::from_slice(&bytes).expect("JSON")
}

#[tokio::test]
async fn over_the_concurrency_limit_a_timeline_query_is_answered_503_with_retry_after() {
    let app = app(
        10,
        TimelineLimits {
            max_concurrent: 1,
            max_bytes: 1 << 20,
        },
    );
    // The first answer holds the one slot until its body is consumed.
    let first = send(&app, "GET", "/api/timeline", Body::empty()).await;
    assert_eq!(first.status(), StatusCode::OK);
    let busy = send(&app, "GET", "/api/timeline", Body::empty()).await;
    assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(busy.headers()[header::RETRY_AFTER], "1");
    let error = json_of(busy).await;
    assert_eq!(error["error"]["status"], 503);
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("retry"),
        "{error}"
    );
    // Other endpoints are not limited.
    let health = send(&app, "GET", "/api/health", Body::empty()).await;
    assert_eq!(health.status(), StatusCode::OK);
    // Sent (here: read), the slot is free again.
    assert_eq!(
        json_of(first).await["traceEvents"]
            .as_array()
            .unwrap()
            .len(),
        10
    );
    let again = send(&app, "GET", "/api/timeline", Body::empty()).await;
    assert_eq!(again.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_timeline_answer_stays_within_its_byte_budget_and_says_truncated() {
    let budget = 100 * 1024;
    let app = app(
        50_000,
        TimelineLimits {
            max_concurrent: 4,
            max_bytes: budget,
        },
    );
    let response = send(&app, "GET", "/api/timeline", Body::empty()).await;
    assert_eq!(response.status(), StatusCode::OK);
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert!(bytes.len() <= budget + 1024, "{} bytes", bytes.len());
    let answer: Value = serde_json::from_slice(&bytes).unwrap();
    let written = answer["traceEvents"].as_array().unwrap().len();
    let note = &answer["metadata"]["truncated"];
    assert_eq!(note["events_written"], written);
    assert_eq!(note["events_left_out"], 50_000 - written);
}

#[tokio::test]
async fn the_frameworks_rejections_are_json_errors() {
    let app = app(1, TimelineLimits::default());
    // A body over the limit (declared, and streamed), a query string
    // that does not decode, a path parameter that is not UTF-8, a
    // method not allowed, an unknown path.
    let big = Body::from(vec![b' '; MAX_BODY_BYTES + 1]);
    let cases = [
        ("POST", "/api/jobs/j/tuning", big, 413),
        ("GET", "/api/timeline?from=%FF", Body::empty(), 400),
        ("GET", "/api/jobs/%FF/tuning", Body::empty(), 400),
        ("PUT", "/api/health", Body::empty(), 405),
        ("GET", "/nope", Body::empty(), 404),
        ("GET", "/api/timeline?from=", Body::empty(), 400),
        ("GET", "/api/timeline?max_events=%2B5", Body::empty(), 400),
        ("GET", "/api/timeline?max_events=05", Body::empty(), 400),
        ("GET", "/api/timeline?max_events=0", Body::empty(), 400),
    ];
    for (method, uri, body, status) in cases {
        let response = send(&app, method, uri, body).await;
        assert_eq!(response.status().as_u16(), status, "{method} {uri}");
        let content_type = response.headers()[header::CONTENT_TYPE].clone();
        assert_eq!(content_type, "application/json", "{method} {uri}");
        let error = json_of(response).await;
        assert_eq!(error["error"]["status"], status, "{method} {uri}: {error}");
        assert!(error["error"]["message"].is_string(), "{error}");
    }
}

#[tokio::test]
async fn cluster_questions_are_checked_and_answered_without_peers() {
    let app = app(3, TimelineLimits::default());
    for (uri, status) in [
        ("/api/timeline?scope=cluster", 404),
        ("/api/timeline?scope=galaxy&job=j", 400),
        ("/api/timeline?clock=tai", 400),
        // No agent of this (peerless) cluster knows the job.
        ("/api/timeline?scope=cluster&job=nope", 404),
        ("/api/jobs/j/load", 400),
        ("/api/jobs/j/load?from_unix_us=1&to_unix_us=2&x=1", 400),
        ("/api/jobs/j/load?from_unix_us=1&to_unix_us=2", 503),
    ] {
        let response = send(&app, "GET", uri, Body::empty()).await;
        assert_eq!(response.status().as_u16(), status, "{uri}");
    }
    let clock = json_of(send(&app, "GET", "/api/clock", Body::empty()).await).await;
    assert_eq!(clock["node"], "test-node");
    let unix = clock["unix_us"].as_f64().unwrap();
    assert!(
        (unix - crate::cluster::unix_now_us()).abs() < 60e6,
        "{clock}"
    );
    let jobs = json_of(send(&app, "GET", "/api/cluster/jobs", Body::empty()).await).await;
    assert_eq!(jobs["jobs"], json!([]));
    assert_eq!(jobs["peers_asked"], 0);
    // A recorded trace stays on its own clock: clock=unix moves nothing.
    let trace = json_of(send(&app, "GET", "/api/timeline?clock=unix", Body::empty()).await).await;
    assert_eq!(trace["traceEvents"][0]["ts"], 0.0, "{trace}");
}

#[tokio::test]
async fn a_future_window_and_an_empty_one_are_both_empty_answers() {
    let app = app(3, TimelineLimits::default());
    for uri in ["/api/timeline?from=1&to=0", "/api/timeline?from=9999999999"] {
        let response = send(&app, "GET", uri, Body::empty()).await;
        assert_eq!(response.status(), StatusCode::OK, "{uri}");
        let answer = json_of(response).await;
        assert!(
            answer["traceEvents"].as_array().unwrap().is_empty(),
            "{uri}"
        );
        assert!(answer["metadata"]["empty_window"].is_string(), "{answer}");
    }
}
