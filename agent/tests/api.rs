//! The HTTP API against a real `ringwatch-agent serve` on loopback: status
//! codes, JSON shapes, the metrics exposition, and bad input (unknown
//! parameters, unknown paths, wrong methods, malformed HTTP), after which the
//! server must still answer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start() -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ringwatch-agent"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[agent] {line}");
                if let Some(rest) = line.split("http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap().to_owned());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the agent did not start serving within 30 s");
        Self { child, addr }
    }

    /// Sends raw bytes, returns (status, headers, body).
    fn raw(&self, request: &[u8]) -> (u16, String, String) {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(request).unwrap();
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no HTTP status in {response:?}"));
        (status, head.to_owned(), body.to_owned())
    }

    fn request(&self, method: &str, path: &str) -> (u16, String, String) {
        self.raw(
            format!(
                "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                self.addr
            )
            .as_bytes(),
        )
    }

    fn get_json(&self, path: &str) -> (u16, serde_json::Value) {
        let (status, head, body) = self.request("GET", path);
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{head}"
        );
        (
            status,
            serde_json::from_str(&body)
                .unwrap_or_else(|e| panic!("{path}: bad JSON ({e}): {body}")),
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn api_answers_and_rejects_bad_input() {
    let server = Server::start();

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
    for path in ["/api/health", "/api/gpus", "/api/openapi.json", "/metrics"] {
        assert!(
            doc["paths"][path]["get"].is_object(),
            "openapi lacks {path}"
        );
    }

    let (status, head, body) = server.request("GET", "/metrics");
    assert_eq!(status, 200);
    assert!(head.contains("openmetrics-text"), "{head}");
    assert!(
        body.contains("# TYPE ringwatch_gpu_nvml_available gauge"),
        "{body}"
    );
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

    // Malformed HTTP: refused, and the server keeps serving.
    let (status, _, _) = server.raw(b"THIS IS NOT HTTP\r\n\r\n");
    assert_eq!(status, 400);
    let (status, _, _) =
        server.raw(b"GET /api/health HTTP/1.1\r\nHost: x\r\nContent-Length: banana\r\n\r\n");
    assert_eq!(status, 400);
    let (status, _) = server.get_json("/api/health");
    assert_eq!(status, 200);
}
