//! What the harness tests share: the built library and a stand-in agent.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The library cargo built for this test: in `target/<profile>/deps/`, where
/// cargo writes a dependency's `cdylib` (it copies it up a level only when it
/// was asked for by name).
pub fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let deps = exe
        .parent()
        .expect("a test lives in target/<profile>/deps/");
    let candidates = [
        deps.join("libringwatch_nccl_profiler.so"),
        deps.parent()
            .unwrap_or(deps)
            .join("libringwatch_nccl_profiler.so"),
    ];
    match candidates.iter().find(|lib| lib.is_file()) {
        Some(lib) => lib.clone(),
        None => panic!("no plugin library at {}", candidates[0].display()),
    }
}

/// A stand-in agent on `path`: answers each hello with `answer` and keeps
/// every line after it.
pub fn fake_agent(path: &Path, answer: &'static str) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let listener = UnixListener::bind(path).unwrap();
    let kept = lines.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let kept = kept.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(&stream);
                let mut hello = String::new();
                if reader.read_line(&mut hello).is_err() {
                    return;
                }
                assert!(
                    hello.contains("\"hello\":\"ringwatch-nccl-profiler\""),
                    "{hello}"
                );
                let _ = (&stream).write_all(answer.as_bytes());
                for line in reader.lines() {
                    let Ok(line) = line else { break };
                    kept.lock().unwrap().push(line);
                }
            });
        }
    });
    lines
}
