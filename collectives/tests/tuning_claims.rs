//! Tuning claims over a real control socket (one-rank job in this process): the autotune
//! state in `hello`, one claim holder at a time, release and disconnect semantics, and a
//! malformed claim that closes only its own connection.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use collectives::control::{
    AutotuneState, ClientMessage, ControlClient, ControlError, ServerMessage, read_message,
    write_message,
};
use collectives::knobs::AutotuneConfig;
use collectives::rendezvous::RendezvousConfig;
use collectives::runtime::RuntimeConfig;
use collectives::{ReduceOp, Runtime, Tensor};
use test_support::eventually_reporting;

/// Every request's and poll's limit: a hang guard that a working job meets at once.
const T: Duration = Duration::from_secs(60);

fn one_rank_job(tag: &str, autotune: Option<AutotuneConfig>) -> (Runtime, PathBuf, PathBuf) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("rw-claims-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = RuntimeConfig::new(RendezvousConfig {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_id: Some(format!("claims-{tag}-{port}")),
        connect_timeout: Duration::from_secs(20),
        host: None,
    });
    c.control_socket = true;
    c.runtime_dir = Some(dir.clone());
    c.autotune = autotune;
    let rt = Runtime::new(c).unwrap();
    let path = rt.control_socket_path().unwrap().to_path_buf();
    (rt, path, dir)
}

/// The state a fresh connection's `hello` reports, polled until it is `want` (the server
/// notices a closed connection asynchronously).
fn await_hello_state(path: &Path, want: AutotuneState) {
    eventually_reporting(
        T,
        &format!("a fresh connection's hello saying {want:?}"),
        || {
            let got = ControlClient::connect(path, T).unwrap().hello().autotune;
            if got == want {
                Ok(())
            } else {
                Err(format!("hello says {got:?}"))
            }
        },
    );
}

fn still_reduces(rt: &Runtime, i: i32) {
    let got = rt
        .allreduce(&format!("t{i}"), Tensor::from_slice(&[i; 8]), ReduceOp::Sum)
        .unwrap();
    assert_eq!(got.to_vec::<i32>().unwrap(), vec![i; 8]);
}

#[test]
fn a_job_that_did_not_ask_says_off_and_still_grants_an_explicit_claim() {
    let (rt, path, dir) = one_rank_job("off", None);
    let mut a = ControlClient::connect(&path, T).unwrap();
    assert_eq!(a.hello().autotune, AutotuneState::Off);
    assert_eq!(a.claim_tuning(T).unwrap(), AutotuneState::Agent);
    assert_eq!(a.release_tuning(true, T).unwrap(), AutotuneState::Done);
    // Releasing again: this client holds nothing.
    assert!(matches!(
        a.release_tuning(true, T),
        Err(ControlError::Server(_))
    ));
    rt.shutdown();
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn claims_are_exclusive_per_connection_and_end_on_release_or_disconnect() {
    // A long wait: the job stays `waiting` and never tunes itself during this test.
    let autotune = AutotuneConfig {
        wait: Duration::from_secs(600),
        ..Default::default()
    };
    let (rt, path, dir) = one_rank_job("claims", Some(autotune));
    let mut a = ControlClient::connect(&path, T).unwrap();
    let mut b = ControlClient::connect(&path, T).unwrap();
    assert_eq!(a.hello().autotune, AutotuneState::Waiting);

    // Granted to the first, refused to the second, which is told why.
    assert_eq!(a.claim_tuning(T).unwrap(), AutotuneState::Agent);
    match b.claim_tuning(T) {
        Err(ControlError::Server(why)) => assert!(why.contains("another"), "{why}"),
        other => panic!("second claim should be refused, got {other:?}"),
    }
    assert!(
        matches!(b.release_tuning(true, T), Err(ControlError::Server(_))),
        "a client without the claim cannot release it"
    );
    await_hello_state(&path, AutotuneState::Agent);
    still_reduces(&rt, 1);

    // Released as completed: done; now the other client may claim (an explicit re-tune).
    assert_eq!(a.release_tuning(true, T).unwrap(), AutotuneState::Done);
    await_hello_state(&path, AutotuneState::Done);
    assert_eq!(b.claim_tuning(T).unwrap(), AutotuneState::Agent);

    // The holder disconnects mid-claim: interrupted, and the claim is free again.
    drop(b);
    await_hello_state(&path, AutotuneState::Interrupted);
    assert_eq!(a.claim_tuning(T).unwrap(), AutotuneState::Agent);
    assert_eq!(
        a.release_tuning(false, T).unwrap(),
        AutotuneState::Interrupted
    );
    still_reduces(&rt, 2);
    rt.shutdown();
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_malformed_claim_closes_only_that_client_and_ends_its_claim() {
    let (rt, path, dir) = one_rank_job("malformed", None);
    let mut bystander = ControlClient::connect(&path, T).unwrap();

    let mut raw = UnixStream::connect(&path).unwrap();
    raw.set_read_timeout(Some(T)).unwrap();
    let hello: ServerMessage = read_message(&mut raw).unwrap();
    assert!(matches!(hello, ServerMessage::Hello(_)));
    write_message(&mut raw, &ClientMessage::ClaimTuning { request_id: 7 }).unwrap();
    let answer: ServerMessage = read_message(&mut raw).unwrap();
    assert!(
        matches!(
            answer,
            ServerMessage::TuningClaim {
                request_id: 7,
                granted: true,
                state: AutotuneState::Agent,
                ..
            }
        ),
        "{answer:?}"
    );
    // A claim message with a wrong field type.
    let body = br#"{"type":"claim_tuning","request_id":"seven"}"#;
    std::io::Write::write_all(&mut raw, &(body.len() as u32).to_be_bytes()).unwrap();
    std::io::Write::write_all(&mut raw, body).unwrap();
    let answer: ServerMessage = read_message(&mut raw).unwrap();
    assert!(
        matches!(&answer, ServerMessage::Error { message, .. } if message.contains("closing")),
        "{answer:?}"
    );
    assert!(matches!(
        read_message::<_, ServerMessage>(&mut raw),
        Err(ControlError::Closed) | Err(ControlError::Io(_))
    ));

    // Its claim ended with it; the other client is unaffected and may claim now.
    await_hello_state(&path, AutotuneState::Interrupted);
    let (knobs, _) = bystander.get_knobs(T).unwrap();
    assert_eq!(knobs, rt.knobs().0);
    assert_eq!(bystander.claim_tuning(T).unwrap(), AutotuneState::Agent);
    still_reduces(&rt, 3);
    rt.shutdown();
    std::fs::remove_dir_all(dir).ok();
}

/// Keeps the one-rank job busy (cycles with work) until `until`, then runs one more
/// cycle: a cycle begun after `until`.
fn keep_busy_until(rt: &Runtime, until: Instant) {
    let mut i = 100;
    while Instant::now() <= until {
        still_reduces(rt, i);
        i += 1;
    }
    still_reduces(rt, i);
}

/// Keeps the one-rank job busy until its autotune state is `want` (60 s: a hang guard).
#[cfg(feature = "autotune")]
fn keep_busy_until_state(rt: &Runtime, want: AutotuneState) {
    let mut i = 1000;
    eventually_reporting(T, &format!("the job's autotune state {want:?}"), || {
        still_reduces(rt, i);
        i += 1;
        match rt.autotune_state() {
            got if got == want => Ok(()),
            got => Err(format!("{got:?}")),
        }
    });
}

#[test]
fn an_agent_claim_during_the_wait_means_the_job_never_tunes_itself() {
    let wait = Duration::from_secs(10);
    let autotune = AutotuneConfig {
        wait,
        min_window: Duration::from_millis(10),
        measured_cycles: 1,
        warmup_cycles: 0,
        ..Default::default()
    };
    let (rt, path, dir) = one_rank_job("agent-first", Some(autotune));
    // The wait began while the runtime started: it is over once `wait` has passed
    // from here (a loaded machine only makes that later).
    let wait_over = Instant::now() + wait;
    let start_knobs = rt.knobs().0;
    let mut agent = ControlClient::connect(&path, T).unwrap();
    // Claimed well inside the wait (a connect and a message; 10 s leaves a
    // loaded machine room), then held while cycles run past the wait's end.
    assert_eq!(agent.claim_tuning(T).unwrap(), AutotuneState::Agent);
    keep_busy_until(&rt, wait_over);
    assert_eq!(rt.autotune_state(), AutotuneState::Agent);
    drop(agent);
    await_hello_state(&path, AutotuneState::Interrupted);
    keep_busy_until(&rt, Instant::now() + Duration::from_millis(500));
    // Interrupted stays interrupted, on the knobs it had: no self-tuning after an agent.
    assert_eq!(rt.autotune_state(), AutotuneState::Interrupted);
    assert_eq!(rt.knobs().0, start_knobs);
    assert!(rt.self_tune_outcome().is_none());
    rt.shutdown();
    std::fs::remove_dir_all(dir).ok();
}

/// Built without the `autotune` feature, an unclaimed job keeps waiting for an agent and
/// runs untuned (`cargo test -p collectives --no-default-features`).
#[cfg(not(feature = "autotune"))]
#[test]
fn without_the_autotune_feature_an_unclaimed_job_runs_untuned_and_keeps_waiting() {
    let autotune = AutotuneConfig {
        wait: Duration::from_millis(100),
        ..Default::default()
    };
    let (rt, path, dir) = one_rank_job("no-feature", Some(autotune));
    let start_knobs = rt.knobs().0;
    // Cycles past the wait's end (it began while the runtime started).
    keep_busy_until(&rt, Instant::now() + Duration::from_millis(500));
    assert_eq!(rt.autotune_state(), AutotuneState::Waiting);
    assert_eq!(rt.knobs().0, start_knobs);
    let mut agent = ControlClient::connect(&path, T).unwrap();
    assert_eq!(agent.claim_tuning(T).unwrap(), AutotuneState::Agent);
    rt.shutdown();
    std::fs::remove_dir_all(dir).ok();
}

/// With the feature, the same job tunes itself once the wait is over.
#[cfg(feature = "autotune")]
#[test]
fn an_unclaimed_job_starts_tuning_itself_after_the_wait_and_refuses_claims_meanwhile() {
    let autotune = AutotuneConfig {
        wait: Duration::from_millis(100),
        // Long windows: the session is still running when the claim comes.
        min_window: Duration::from_secs(60),
        ..Default::default()
    };
    let (rt, path, dir) = one_rank_job("self", Some(autotune));
    // Cycles run until the job has begun to tune itself: the first after the
    // wait, however late a loaded machine runs it.
    keep_busy_until_state(&rt, AutotuneState::SelfTuning);
    let mut agent = ControlClient::connect(&path, T).unwrap();
    assert_eq!(agent.hello().autotune, AutotuneState::SelfTuning);
    match agent.claim_tuning(T) {
        Err(ControlError::Server(why)) => assert!(why.contains("tuning itself"), "{why}"),
        other => panic!("a claim during self-tuning must be refused, got {other:?}"),
    }
    rt.shutdown();
    std::fs::remove_dir_all(dir).ok();
}
