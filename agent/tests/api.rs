//! The HTTP API against a real `ringwatch-agent serve` on loopback: status
//! codes, JSON shapes, the metrics exposition, and bad input (unknown
//! parameters, unknown paths, wrong methods, malformed HTTP), after which the
//! server must still answer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

use common::ApiServer as Server;

#[test]
fn api_answers_and_rejects_bad_input() {
    let server = Server::start(&[], false);

    let (status, health) = server.get_json("/api/health");
    assert_eq!(status, 200);
    assert_eq!(health["status"], "ok");
    assert!(health["uptime_s"].as_f64().unwrap() >= 0.0);

    // No NVIDIA driver in CI: an empty list with the reason.
    let (status, gpus) = server.get_json("/api/gpus");
    assert_eq!(status, 200);
    assert!(gpus["gpus"].is_array(), "{gpus}");
    if gpus["gpus"].as_array().unwrap().is_empty() {
        assert!(
            gpus["unavailable_reason"]
                .as_str()
                .unwrap()
                .contains("NVIDIA")
                || gpus["unavailable_reason"]
                    .as_str()
                    .unwrap()
                    .contains("nvidia"),
            "{gpus}"
        );
    }

    let (status, doc) = server.get_json("/api/openapi.json");
    assert_eq!(status, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    for path in [
        "/api/health",
        "/api/gpus",
        "/api/openapi.json",
        "/metrics",
        "/api/jobs/{id}/tuning",
        "/api/reports",
        "/api/reports/{id}",
    ] {
        assert!(
            doc["paths"][path]["get"].is_object(),
            "openapi lacks {path}"
        );
    }
    for method in ["post", "delete"] {
        let operation = &doc["paths"]["/api/jobs/{id}/tuning"][method];
        assert!(operation["responses"]["401"].is_object(), "{operation}");
        assert!(operation["responses"]["403"].is_object(), "{operation}");
    }

    // Classic text by default (what promtool and curl get), OpenMetrics on request.
    let (status, head, body) = server.request("GET", "/metrics");
    assert_eq!(status, 200);
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert!(
        body.contains("# TYPE ringwatch_gpu_nvml_available gauge"),
        "{body}"
    );
    assert!(!body.contains("# EOF"), "{body}");
    common::promtool_check_metrics(&body);
    let (status, head, body) = server.send(
        "GET",
        "/metrics",
        &["Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"],
        "",
    );
    assert_eq!(status, 200);
    assert!(head.contains("application/openmetrics-text"), "{head}");
    assert!(body.trim_end().ends_with("# EOF"), "{body}");

    // The embedded viewer.
    let (status, head, body) = server.request("GET", "/");
    assert_eq!(status, 200);
    assert!(head.contains("text/html"), "{head}");
    assert!(body.contains("viewer.js"), "{body}");
    let (status, head, body) = server.request("GET", "/viewer.js");
    assert_eq!(status, 200);
    assert!(head.contains("javascript"), "{head}");
    assert!(body.contains("ringwatchViewer"));

    // Bad input: JSON errors with the right status, saying what is wrong.
    let (status, error) = server.get_json("/api/health?verbose=1");
    assert_eq!(status, 400);
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("verbose"),
        "{error}"
    );
    let (status, error) = server.get_json("/api/nothing-here");
    assert_eq!(status, 404);
    assert_eq!(error["error"]["status"], 404);
    let (status, head, _) = server.request("DELETE", "/api/health");
    assert_eq!(status, 405, "{head}");

    // No timeline source without --replay (yet): said plainly.
    let (status, error) = server.get_json("/api/timeline?from=now-10s");
    assert_eq!(status, 503, "{error}");

    // Malformed HTTP: refused, and the server keeps serving.
    let (status, _, _) = server.raw(b"THIS IS NOT HTTP\r\n\r\n");
    assert_eq!(status, 400);
    let (status, _, _) =
        server.raw(b"GET /api/health HTTP/1.1\r\nHost: x\r\nContent-Length: banana\r\n\r\n");
    assert_eq!(status, 400);
    let (status, _) = server.get_json("/api/health");
    assert_eq!(status, 200);
}

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../ui/tests/fixtures/ringwatch-2ranks.json"
);

#[test]
fn a_recorded_trace_is_served_as_a_bounded_chrome_trace() {
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(FIXTURE).unwrap()).unwrap();
    let timed = |events: &serde_json::Value| {
        events
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] != "M")
            .count()
    };
    let total = timed(&fixture["traceEvents"]);
    assert!(total > 100, "the fixture should be a real trace");

    let server = Server::start(&["--replay", FIXTURE], false);
    let (status, whole) = server.get_json("/api/timeline");
    assert_eq!(status, 200);
    assert_eq!(timed(&whole["traceEvents"]), total);
    assert_eq!(
        whole["metadata"]["now"].as_f64(),
        fixture["metadata"]["now"].as_f64()
    );

    // A window at the end holds fewer events, each overlapping it.
    let now = fixture["metadata"]["now"].as_f64().unwrap();
    let (status, window) = server.get_json("/api/timeline?from=now-50ms");
    assert_eq!(status, 200);
    let events = window["traceEvents"].as_array().unwrap();
    assert!(timed(&window["traceEvents"]) < total);
    for e in events.iter().filter(|e| e["ph"] != "M") {
        let end = e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap_or(0.0);
        assert!(end >= now - 50_000.0, "{e} ends before the window");
    }

    let (status, jobs) = server.get_json("/api/jobs");
    assert_eq!(status, 200);
    assert_eq!(jobs["jobs"][0]["id"], "resnet50", "{jobs}");
    let (status, by_pid) = server.get_json("/api/timeline?pid=4201");
    assert_eq!(status, 200);
    assert!(
        by_pid["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["pid"] == 4201)
    );

    let (status, error) = server.get_json("/api/timeline?from=yesterday");
    assert_eq!(status, 400);
    assert!(
        error["error"]["message"].as_str().unwrap().contains("from"),
        "{error}"
    );
    // A window that ends before it begins holds nothing, and says why.
    let (status, empty) = server.get_json("/api/timeline?from=200&to=100");
    assert_eq!(status, 200);
    assert!(empty["metadata"]["empty_window"].is_string(), "{empty}");
    assert!(
        empty["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["ph"] == "M"),
        "{empty}"
    );
    let (status, _) = server.get_json("/api/timeline?job=nope");
    assert_eq!(status, 404);
    let (status, _) = server.get_json("/api/timeline?limit=5");
    assert_eq!(status, 400);
    // A client may ask for fewer events: over that, refused or downsampled.
    let (status, _) = server.get_json("/api/timeline?max_events=5");
    assert_eq!(status, 413);
    let (status, _) = server.get_json("/api/timeline?max_events=0");
    assert_eq!(status, 400);
    // A level of detail: the whole fixture on 10 pixels is a few summaries
    // per track, still a valid trace; bad pixels are refused.
    for bad in [
        "width=0",
        "width=100001",
        "width=1.5",
        "resolution=0",
        "resolution=-3",
        "resolution=inf",
        "resolution=1.00000000000000000000000",
    ] {
        let (status, error) = server.get_json(&format!("/api/timeline?{bad}"));
        assert_eq!(status, 400, "{bad}: {error}");
    }
    let (status, coarse) = server.get_json("/api/timeline?width=10");
    assert_eq!(status, 200);
    common::assert_trace_event_format(&coarse);
    let detail = &coarse["metadata"]["detail"];
    let summaries = coarse["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["args"].get("summary").is_some())
        .count();
    assert!(summaries > 0, "{detail}");
    assert_eq!(detail["summary_slices"], summaries, "{detail}");
    // Every other event stays; the slices are fewer.
    let (slices, kept) = (
        detail["slices_in_range"].as_u64().unwrap() as usize,
        detail["slices_kept"].as_u64().unwrap() as usize,
    );
    assert!(kept + summaries < slices / 2, "{detail}");
    assert_eq!(
        timed(&coarse["traceEvents"]),
        total - slices + kept + summaries,
        "{detail}"
    );
    // The overview: per process, its threads' states and its activities
    // merged into two counters; a valid trace, and a bad view is refused.
    let (status, overview) = server.get_json("/api/timeline?view=overview&width=50");
    assert_eq!(status, 200);
    common::assert_trace_event_format(&overview);
    let events = overview["traceEvents"].as_array().unwrap();
    assert!(
        !events.iter().any(|e| e["cat"] == "thread_state"),
        "states left in the overview"
    );
    // (Rank 1's activities are B/E pairs in the fixture: a recorded trace's
    // B/E events are answered as they are, not merged.)
    for (pid, name) in [(4101, "threads"), (4201, "threads"), (4101, "activity")] {
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "C" && e["name"] == name && e["pid"] == pid),
            "no {name} counter for {pid}"
        );
    }
    assert!(
        overview["metadata"]["detail"]["overview"]["slices_merged"]
            .as_u64()
            .unwrap()
            > 0
    );
    let (status, _) = server.get_json("/api/timeline?view=summary");
    assert_eq!(status, 400);
    let (status, same) =
        server.get_json(&format!("/api/timeline?resolution={}", detail["pixel_us"]));
    assert_eq!(status, 200);
    assert_eq!(same["metadata"]["detail"]["summary_slices"], summaries);
    // The fixture: 1400 job and counter events and 400 thread states;
    // room for 50 of the states.
    let (status, thin) = server.get_json("/api/timeline?max_events=1450&downsample=true");
    assert_eq!(status, 200);
    let note = &thin["metadata"]["downsampled"];
    assert_eq!(timed(&thin["traceEvents"]), 1450, "{note}");
    assert_eq!(note["thread_state_slices_kept"], 50, "{note}");
    assert_eq!(
        timed(&thin["traceEvents"])
            + note["thread_state_slices_dropped"].as_u64().unwrap() as usize,
        total,
        "kept + dropped = the whole trace: {note}"
    );

    let small = Server::start(
        &["--replay", FIXTURE, "--timeline-event-limit", "10"],
        false,
    );
    let (status, error) = small.get_json("/api/timeline");
    assert_eq!(status, 413);
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("narrow"),
        "{error}"
    );
}

#[test]
fn a_missing_replay_file_is_a_clear_error() {
    let output = Command::new(env!("CARGO_BIN_EXE_ringwatch-agent"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--replay",
            "/nonexistent/trace.json",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent/trace.json"), "{stderr}");
}

/// The Trace Event Format check the live tests apply refuses what the spec
/// does: an `X` without `dur`, events of a thread nobody named, an `E`
/// without its `B`.
#[test]
fn the_trace_format_check_refuses_malformed_traces() {
    use serde_json::json;
    let named = |events: serde_json::Value| {
        let mut all = vec![
            json!({ "ph": "M", "name": "process_name", "pid": 1, "args": { "name": "p" } }),
            json!({ "ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": { "name": "t" } }),
        ];
        all.extend(events.as_array().unwrap().iter().cloned());
        json!({ "traceEvents": all })
    };
    common::assert_trace_event_format(&named(json!([
        { "ph": "X", "name": "running", "pid": 1, "tid": 2, "ts": 1.0, "dur": 2.0 },
        { "ph": "C", "name": "tcp", "pid": 1, "ts": 1.0, "args": { "tx": 3 } },
    ])));
    for bad in [
        json!([{ "ph": "X", "name": "running", "pid": 1, "tid": 2, "ts": 1.0 }]),
        json!([{ "ph": "X", "name": "running", "pid": 1, "tid": 3, "ts": 1.0, "dur": 1.0 }]),
        json!([{ "ph": "E", "pid": 1, "tid": 2, "ts": 1.0 }]),
        json!([{ "ph": "C", "name": "tcp", "pid": 1, "ts": 1.0, "args": { "tx": "3" } }]),
        json!([{ "ph": "M", "name": "thread_colour", "pid": 1, "tid": 2, "args": {} }]),
    ] {
        let trace = named(bad.clone());
        let refused = std::panic::catch_unwind(|| common::assert_trace_event_format(&trace));
        assert!(refused.is_err(), "accepted {bad}");
    }
}

/// The OpenAPI document is derived from the handlers; its snapshot at
/// `docs/reference/openapi.json` is what clients and the docs read. A
/// change to a handler's types or attributes changes the served document,
/// and this test says so until the snapshot is regenerated.
#[test]
fn reference_openapi_json_is_the_served_document() {
    const SNAPSHOT: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/reference/openapi.json"
    );
    let server = Server::start(&[], false);
    let (status, served) = server.get_json("/api/openapi.json");
    assert_eq!(status, 200, "{served}");
    let rendered = serde_json::to_string_pretty(&served).unwrap() + "\n";
    if std::env::var_os("RINGWATCH_UPDATE_SNAPSHOTS").is_some()
        || std::env::var("RINGWATCH_UPDATE_REFERENCE").as_deref() == Ok("1")
    {
        std::fs::write(SNAPSHOT, &rendered).unwrap();
        return;
    }
    let snapshot = std::fs::read_to_string(SNAPSHOT).unwrap_or_default();
    let committed: serde_json::Value = serde_json::from_str(&snapshot).unwrap_or_default();
    assert!(
        committed == served,
        "{SNAPSHOT} differs from the document the agent serves (derived from the handlers \
         in agent/src/api); regenerate it with \
         `RINGWATCH_UPDATE_SNAPSHOTS=1 cargo test -p agent --test api openapi` and commit it"
    );
}

#[path = "../../xtask/src/cli_reference.rs"]
mod cli_reference;

/// `docs/reference/api.md`: every operation of the document the agent
/// serves, with its parameters and answers (`cargo xtask reference` writes
/// it; the JSON is `docs/reference/openapi.json`).
#[test]
fn reference_api_is_current() {
    let server = Server::start(&[], false);
    let (status, doc) = server.get_json("/api/openapi.json");
    assert_eq!(status, 200, "{doc}");
    let schemas = &doc["components"]["schemas"];
    // A parameter's type: its own schema, or the component it names.
    let kind = |schema: &serde_json::Value| -> String {
        let resolved = schema["$ref"]
            .as_str()
            .and_then(|r| r.rsplit('/').next())
            .map_or(schema, |name| &schemas[name]);
        let mut text = match resolved["enum"].as_array() {
            Some(values) => values
                .iter()
                .map(|v| format!("`{}`", v.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(" \\| "),
            None => resolved["type"].as_str().unwrap_or("object").to_owned(),
        };
        if let Some(default) = schema["default"].as_str() {
            text.push_str(&format!(" (default `{default}`)"));
        }
        text
    };
    let mut page = format!(
        "# HTTP API\n\n\
         <!-- Rendered from the agent's derived OpenAPI document by `cargo xtask reference`; do not edit. -->\n\n\
         {} The agent serves the whole document at `/api/openapi.json`; its snapshot is \
         [openapi.json](openapi.json). Errors are JSON: `{{\"error\": \"…\"}}`.\n",
        doc["info"]["description"].as_str().unwrap_or_default()
    );
    for (path, operations) in doc["paths"].as_object().unwrap() {
        for (method, op) in operations.as_object().unwrap() {
            page.push_str(&format!("\n## `{} {path}`\n\n", method.to_uppercase()));
            let summary = op["summary"].as_str().unwrap_or_default();
            let description = op["description"].as_str().unwrap_or_default();
            for text in [summary, description] {
                if !text.is_empty() {
                    page.push_str(&format!("{}\n\n", cli_reference::cell(text)));
                }
            }
            if op["security"].is_array() {
                page.push_str(
                    "Needs the API token (`Authorization: Bearer …`) where the agent has one.\n\n",
                );
            }
            if let Some(params) = op["parameters"].as_array().filter(|p| !p.is_empty()) {
                page.push_str("| parameter | in | type | what it does |\n|---|---|---|---|\n");
                for p in params {
                    let required = if p["required"] == true {
                        " (required)"
                    } else {
                        ""
                    };
                    page.push_str(&format!(
                        "| `{}`{required} | {} | {} | {} |\n",
                        p["name"].as_str().unwrap_or_default(),
                        p["in"].as_str().unwrap_or_default(),
                        kind(&p["schema"]),
                        cli_reference::cell(p["description"].as_str().unwrap_or_default()),
                    ));
                }
                page.push('\n');
            }
            page.push_str("| answer | what it means |\n|---|---|\n");
            for (code, answer) in op["responses"].as_object().unwrap() {
                page.push_str(&format!(
                    "| {code} | {} |\n",
                    cli_reference::cell(answer["description"].as_str().unwrap_or_default())
                ));
            }
        }
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/reference/api.md");
    cli_reference::check_page(std::path::Path::new(path), &page);
}
