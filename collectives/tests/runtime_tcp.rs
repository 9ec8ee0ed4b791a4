//! The runtime over real links — shared memory between the ranks of this host, and loopback
//! TCP with shared memory off — one thread per rank in this process: every op and
//! dtype against an independent reference, fusion on and off, hierarchical layouts, live
//! knob changes, mismatches, a silent rank, the control socket and the timeline, and the
//! response cache (on by default here, as in a job) against the name path.
//!
//! Reference data are small integers (|x| ≤ 20), exactly representable in every dtype
//! (f16 and bf16 included) with exact sums for up to 8 ranks, so the reduction order does
//! not matter and results can be compared bitwise. `Average` on floats is computed as the
//! runtime documents it: the exact sum divided by the world size in the tensor's dtype
//! (f16/bf16 through f32, rounded once). The in-crate algorithm tests check random floats
//! against the ring's own reduction order.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use collectives::control::{
    ClientMessage, ControlClient, KnobUpdate, ServerMessage, read_message, write_message,
};
use collectives::mesh::HostTransport;
use collectives::rendezvous::rendezvous;
use collectives::{CollectiveError, DType, Knobs, ReduceOp, Runtime, Tensor};

fn sizes(n: usize) -> Vec<usize> {
    vec![0, 1, n * 3, n * 3 + 1, 1031]
}

/// Enqueues every op × dtype × size at once, plus allgathers and broadcasts, and checks
/// every result bitwise. Returns how many tensors were checked.
fn check_everything(rt: &Runtime, seed: usize) -> usize {
    let n = rt.world_size();
    let rank = rt.rank();
    let mut handles = Vec::new();
    for dtype in DTYPES {
        for op in OPS {
            for count in sizes(n) {
                let name = format!("ar.{dtype:?}.{op:?}.{count}.{seed}");
                let h = rt
                    .allreduce_async(&name, input_for(op, dtype, rank, count, seed), op)
                    .unwrap();
                handles.push((h, reference(dtype, op, n, count, seed)));
            }
        }
    }
    // Allgather: rank r contributes (r + seed) % 3 rows of width 3 (zero rows included).
    for dtype in [DType::F32, DType::I64] {
        let rows = |r: usize| (r + seed) % 3;
        let mine: Vec<i64> = (0..rows(rank) * 3).map(|i| value(rank, i, seed)).collect();
        let all: Vec<i64> = (0..n)
            .flat_map(|r| (0..rows(r) * 3).map(move |i| value(r, i, seed)))
            .collect();
        let total: usize = (0..n).map(rows).sum();
        let h = rt
            .allgather_async(
                &format!("ag.{dtype:?}.{seed}"),
                make(dtype, &[rows(rank), 3], &mine),
            )
            .unwrap();
        handles.push((h, make(dtype, &[total, 3], &all)));
    }
    // Broadcast from a root that moves with the seed.
    let root = seed % n;
    let count = 300_001;
    let root_vals: Vec<i64> = (0..count).map(|i| value(root, i, seed)).collect();
    let mine: Vec<i64> = if rank == root {
        root_vals.clone()
    } else {
        vec![0; count]
    };
    let h = rt
        .broadcast_async(
            &format!("bc.{seed}"),
            make(DType::F32, &[count], &mine),
            root,
        )
        .unwrap();
    handles.push((h, make(DType::F32, &[count], &root_vals)));
    let checked = handles.len();
    for (h, expected) in handles {
        let name = h.name().to_string();
        let got = h.wait_timeout(Duration::from_secs(60)).unwrap();
        assert!(
            got == expected,
            "rank {rank}: {name} differs from the reference"
        );
    }
    checked
}

#[test]
fn every_op_and_dtype_matches_the_reference_for_world_sizes_1_to_8() {
    for n in 1..=8 {
        let checked = run_job(
            n,
            n,
            Duration::from_secs(120),
            |_| {},
            |rt| {
                // One host: every other rank is reached through shared memory.
                let others: Vec<usize> = (0..rt.world_size()).filter(|&r| r != rt.rank()).collect();
                assert_eq!(rt.shared_memory_peers(), others);
                check_everything(rt, rt.world_size())
            },
        );
        assert!(checked.iter().all(|&c| c == checked[0] && c > 100));
    }
}

#[test]
fn every_op_and_dtype_matches_the_reference_over_tcp_alone() {
    // The tests above run the ranks of a job on one host, so their data go through shared
    // memory; here the same checks go over TCP only, flat and hierarchical.
    for (n, local_size, hierarchical) in [
        (2, 2, false),
        (3, 3, false),
        (5, 5, false),
        (8, 8, false),
        (4, 2, true),
    ] {
        let checked = run_job(
            n,
            local_size,
            Duration::from_secs(120),
            move |c| {
                c.shared_memory = false;
                c.knobs.hierarchical_allreduce = hierarchical;
            },
            |rt| {
                assert!(rt.shared_memory_peers().is_empty());
                check_everything(rt, rt.world_size() + 20)
            },
        );
        assert!(checked.iter().all(|&c| c == checked[0] && c > 100));
    }
}

#[test]
fn an_idle_job_starts_a_cycle_when_work_arrives_instead_of_waiting_out_its_cycle_time() {
    // A cycle time of 60 s: three blocking allreduces one after the other
    // would take three minutes if each waited for the next cycle (past this
    // test's limit of two). The job is idle before each (nothing in flight),
    // so each starts at once. The bound, half of one cycle time, is a check
    // of that behaviour with a wide margin for a loaded machine, not of
    // speed (`cargo xtask bench compare` measures that).
    let cycle = Duration::from_secs(60);
    let elapsed = run_job(
        3,
        3,
        Duration::from_secs(120),
        move |c| c.knobs.cycle_time_us = cycle.as_micros() as u64,
        |rt| {
            let started = Instant::now();
            for seed in 0..3 {
                let t = input(DType::F32, rt.rank(), 1024, seed);
                let got = rt
                    .allreduce(&format!("idle.{seed}"), t, ReduceOp::Sum)
                    .unwrap();
                assert_eq!(got, reference(DType::F32, ReduceOp::Sum, 3, 1024, seed));
            }
            started.elapsed()
        },
    );
    for e in elapsed {
        assert!(e < cycle / 2, "three idle allreduces took {e:?}");
    }
}

#[test]
fn blocking_callers_run_their_own_cycles_and_leave_the_background_thread_asleep() {
    // Two ranks in shared memory, 2000 blocking allreduces each, a cycle time
    // of 5 ms. Each caller runs its own cycle (`Handle::drive`): the background
    // thread may run one on its timer (at most one per cycle time) and must not
    // take the callers' tensors as they come. It used to, in some runs: once it
    // had run one cycle, every next call woke it and it raced the caller for the
    // engine. The results are checked against the reference too.
    let cycle = Duration::from_millis(5);
    let calls = 2000;
    let out = run_job(
        2,
        2,
        Duration::from_secs(120),
        move |c| c.knobs.cycle_time_us = cycle.as_micros() as u64,
        move |rt| {
            let before = rt.totals();
            let started = Instant::now();
            for seed in 0..calls {
                let t = input(DType::F32, rt.rank(), 1024, seed);
                let got = rt.allreduce("drive", t, ReduceOp::Sum).unwrap();
                assert_eq!(got, reference(DType::F32, ReduceOp::Sum, 2, 1024, seed));
            }
            let after = rt.totals();
            (
                after.cycles - before.cycles,
                after.caller_cycles - before.caller_cycles,
                started.elapsed(),
            )
        },
    );
    for (rank, (cycles, by_callers, elapsed)) in out.into_iter().enumerate() {
        let timer_cycles = (elapsed.as_micros() / cycle.as_micros()) as u64 + 2;
        assert!(
            cycles - by_callers <= timer_cycles,
            "rank {rank}: {cycles} cycles, {by_callers} run by the caller, in {elapsed:?}"
        );
    }
}

/// Random floats in [-1, 1) for `rank`'s input of a step: sums of these depend on the
/// order they are added in.
fn floats(rank: usize, count: usize, step: usize) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed((rank * 1_000_003 + count * 101 + step) as u64);
    (0..count).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

/// The ring's result for [`floats`], computed here element by element: element `i` of
/// segment `j` (the world size's near-equal parts, the larger ones first) is
/// accumulated over ranks `j, j+1, …` in that order; `Average` divides the sum once.
fn ring_order(n: usize, count: usize, step: usize, op: ReduceOp) -> Vec<f32> {
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| floats(r, count, step)).collect();
    let (base, extra) = (count / n, count % n);
    let segment_of = |i: usize| {
        let big = extra * (base + 1);
        if i < big {
            i / (base + 1)
        } else {
            extra + (i - big) / base
        }
    };
    (0..count)
        .map(|i| {
            let j = segment_of(i);
            let mut acc = inputs[j][i];
            for k in 1..n {
                let x = inputs[(j + k) % n][i];
                acc = match op {
                    ReduceOp::Max => acc.max(x),
                    _ => acc + x,
                };
            }
            if op == ReduceOp::Average {
                acc / n as f32
            } else {
                acc
            }
        })
        .collect()
}

#[test]
fn blocking_allreduces_of_cached_tensors_take_the_quick_path_and_keep_the_ring_order() {
    // A blocking allreduce of a tensor negotiated before, on a job in one segment, runs
    // as its own settled cycle without an inbox entry (`runtime::quick`). Its results
    // must be the ring's, bit for bit, at every size: one element, odd sizes, the
    // one-shot's 64 KiB and a chunked 1.2 MB; and it must actually run (counted).
    for n in [2, 3, 4] {
        let out = run_job(
            n,
            n,
            Duration::from_secs(120),
            |_| {},
            |rt| {
                let (n, rank) = (rt.world_size(), rt.rank());
                let before = rt.totals();
                let mut calls = 0;
                for count in [1, 1031, 16 * 1024, 300_001] {
                    for op in [ReduceOp::Sum, ReduceOp::Average, ReduceOp::Max] {
                        let name = format!("quick.{count}.{op:?}");
                        for step in 0..5 {
                            let t = Tensor::from_slice(&floats(rank, count, step));
                            let got = rt.allreduce(&name, t, op).unwrap().to_vec::<f32>().unwrap();
                            let want = ring_order(n, count, step, op);
                            let wrong = got
                                .iter()
                                .zip(&want)
                                .filter(|(a, b)| a.to_bits() != b.to_bits())
                                .count();
                            assert_eq!(wrong, 0, "rank {rank} of {n}: {name} step {step}");
                            calls += 1;
                        }
                    }
                }
                (rt.totals().quick_cycles - before.quick_cycles, calls)
            },
        );
        for (rank, (quick, calls)) in out.into_iter().enumerate() {
            assert!(
                quick > 0,
                "rank {rank} of {n}: no quick cycle in {calls} calls"
            );
        }
    }
}

#[test]
fn a_quick_post_the_other_ranks_do_not_match_is_negotiated_in_the_same_cycle() {
    // Rank 1 enqueues "b" asynchronously before each blocking "a", so its posts name
    // "b" (and "a") while rank 0's quick post names "a" alone: the posts differ and
    // rank 0's quick path must turn "a" into an ordinary pending tensor that rank 0
    // schedules, then run "b" when it comes. Every result is checked exactly.
    let steps = 300;
    run_job(
        2,
        2,
        Duration::from_secs(120),
        |_| {},
        move |rt| {
            let rank = rt.rank();
            let a = |step| input(DType::F32, rank, 1024, step);
            let b = |step| input(DType::F32, rank, 256, step + 1000);
            let want_a = |step| reference(DType::F32, ReduceOp::Sum, 2, 1024, step);
            let want_b = |step| reference(DType::F32, ReduceOp::Sum, 2, 256, step + 1000);
            for step in 0..steps {
                if rank == 1 {
                    let hb = rt.allreduce_async("b", b(step), ReduceOp::Sum).unwrap();
                    assert_eq!(
                        rt.allreduce("a", a(step), ReduceOp::Sum).unwrap(),
                        want_a(step)
                    );
                    assert_eq!(hb.wait().unwrap(), want_b(step));
                } else {
                    assert_eq!(
                        rt.allreduce("a", a(step), ReduceOp::Sum).unwrap(),
                        want_a(step)
                    );
                    assert_eq!(
                        rt.allreduce("b", b(step), ReduceOp::Sum).unwrap(),
                        want_b(step)
                    );
                }
            }
        },
    );
}

#[test]
fn a_rank_that_leaves_during_quick_cycles_is_named_by_the_others() {
    // Three ranks reduce "x" until it runs on the quick path, then rank 2 leaves
    // (interrupted, as by a signal) while ranks 0 and 1 wait in their quick post for
    // it: both must fail, naming rank 2, and later calls must fail at once.
    let n = 3;
    let port = free_port();
    let warm = Arc::new(Barrier::new(n));
    let mut handles = Vec::new();
    for rank in 0..n {
        let warm = warm.clone();
        handles.push(std::thread::spawn(move || {
            let mut cfg = config(rank, n, n, port);
            // Long enough that no rank gives up on a live peer a loaded machine slows
            // while they warm up: only rank 2's departure makes them fail.
            cfg.timeout = Duration::from_secs(10);
            // No idle cycles on the background thread's timer (1 s, the most): the call that
            // meets the departure is the caller's own quick cycle.
            cfg.knobs.cycle_time_us = 1_000_000;
            let rt = Runtime::new(cfg).unwrap();
            for _ in 0..20 {
                rt.allreduce("x", Tensor::from_slice(&[1.0f32; 256]), ReduceOp::Sum)
                    .unwrap();
            }
            let quick = rt.totals().quick_cycles;
            warm.wait();
            if rank == 2 {
                std::thread::sleep(Duration::from_millis(200));
                rt.interrupter().interrupt("test: rank 2 leaves");
                return (rank, quick, String::new(), None);
            }
            let err = rt
                .allreduce("x", Tensor::from_slice(&[1.0f32; 256]), ReduceOp::Sum)
                .unwrap_err();
            let later = rt
                .allreduce("x", Tensor::from_slice(&[1.0f32; 256]), ReduceOp::Sum)
                .unwrap_err();
            (rank, quick, err.to_string(), Some(later))
        }));
    }
    for h in handles {
        let (rank, quick, err, later) = h.join().unwrap();
        assert!(quick > 0, "rank {rank}: no quick cycle while warming up");
        let Some(later) = later else { continue };
        assert!(err.contains("rank 2"), "rank {rank}: {err}");
        assert!(
            !matches!(later, CollectiveError::WaitTimeout { .. }),
            "rank {rank}: {later}"
        );
    }
}

#[test]
fn fusion_disabled_and_tiny_threshold_give_the_same_results() {
    for threshold in [0u64, 100] {
        run_job(
            3,
            3,
            Duration::from_secs(120),
            move |c| c.knobs.fusion_threshold_bytes = threshold,
            |rt| check_everything(rt, 11),
        );
    }
}

#[test]
fn hierarchical_layouts_2x2_2x3_3x2_and_fallback_are_correct() {
    for (n, local_size) in [(4, 2), (6, 3), (6, 2), (5, 2)] {
        // (5, 2) has nodes of unequal size: the runtime must fall back to the ring.
        run_job(
            n,
            local_size,
            Duration::from_secs(120),
            |c| c.knobs.hierarchical_allreduce = true,
            |rt| check_everything(rt, 5),
        );
    }
}

#[test]
fn random_knob_changes_during_a_long_mixed_stream_change_no_result() {
    let n = 4;
    let results = run_job(
        n,
        2,
        Duration::from_secs(120),
        |_| {},
        move |rt| {
            let rank = rt.rank();
            let mut rng = fastrand::Rng::with_seed(rank as u64 + 99);
            let mut checked = 0;
            for batch in 0..40 {
                // Every rank asks for changes now and then; rank 0 orders them.
                if rng.u32(0..3) == 0 {
                    rt.set_knobs(KnobUpdate {
                        fusion_threshold_bytes: Some(
                            [0u64, 64, 4096, 1 << 20, 64 << 20][rng.usize(0..5)],
                        ),
                        cycle_time_us: Some(rng.u64(100..3000)),
                        hierarchical_allreduce: Some(rng.bool()),
                    });
                }
                let mut handles = Vec::new();
                for k in 0..8 {
                    // The same sequence on every rank: derived from batch and k, not rng.
                    let dtype = DTYPES[(batch + k) % DTYPES.len()];
                    let op = OPS[(batch * 3 + k) % OPS.len()];
                    let count = [0usize, 1, 5, 64, 777, 4099][(batch + 2 * k) % 6];
                    let seed = batch * 8 + k;
                    let name = format!("s.{batch}.{k}");
                    let h = rt
                        .allreduce_async(&name, input_for(op, dtype, rank, count, seed), op)
                        .unwrap();
                    handles.push((h, reference(dtype, op, n, count, seed)));
                }
                for (h, expected) in handles {
                    let name = h.name().to_string();
                    assert!(h.wait().unwrap() == expected, "rank {rank}: {name} changed");
                    checked += 1;
                }
            }
            (checked, rt.knobs())
        },
    );
    assert!(results.iter().all(|(c, _)| *c == 320));
}

#[test]
fn mismatched_shapes_fail_on_every_rank_naming_tensor_and_ranks_and_the_job_goes_on() {
    let results = run_job(
        3,
        3,
        Duration::from_secs(60),
        |_| {},
        |rt| {
            let rank = rt.rank();
            let len = if rank == 1 { 5 } else { 4 };
            let bad = rt
                .allreduce_async("bad", Tensor::from_slice(&vec![1.0f32; len]), ReduceOp::Sum)
                .unwrap();
            let dtype_bad = if rank == 2 {
                rt.allreduce_async("bad.dtype", Tensor::from_slice(&[1i32; 4]), ReduceOp::Sum)
            } else {
                rt.allreduce_async("bad.dtype", Tensor::from_slice(&[1.0f32; 4]), ReduceOp::Sum)
            }
            .unwrap();
            let good = rt
                .allreduce("good", Tensor::from_slice(&[rank as i64; 3]), ReduceOp::Sum)
                .unwrap();
            let e1 = bad.wait().unwrap_err();
            let e2 = dtype_bad.wait().unwrap_err();
            // The name is free again: the job continues with it.
            let again = rt
                .allreduce("bad", Tensor::from_slice(&[2.0f32; 4]), ReduceOp::Sum)
                .unwrap();
            (e1, e2, good, again)
        },
    );
    for (e1, e2, good, again) in results {
        let m1 = e1.to_string();
        assert!(matches!(e1, CollectiveError::Mismatch { .. }), "{m1}");
        assert!(
            m1.contains("'bad'")
                && m1.contains("[5] on ranks [1]")
                && m1.contains("[4] on ranks [0, 2]"),
            "{m1}"
        );
        let m2 = e2.to_string();
        assert!(
            m2.contains("'bad.dtype'") && m2.contains("I32 on ranks [2]"),
            "{m2}"
        );
        assert_eq!(good.to_vec::<i64>().unwrap(), vec![3, 3, 3]);
        assert_eq!(again.to_vec::<f32>().unwrap(), vec![6.0; 4]);
    }
}

#[test]
fn a_silent_rank_makes_every_other_rank_fail_within_the_timeout_naming_it() {
    let n = 4;
    let port = free_port();
    // Long enough that the live ranks never give up on each other while a loaded machine
    // runs their start-up: the errors then come from rank 2's silence alone.
    let timeout = Duration::from_secs(10);
    let barrier = Arc::new(Barrier::new(n));
    // Released once every other rank has its error: so the errors cannot
    // come from the silent rank's links closing, only from its silence.
    let all_failed = Arc::new(Barrier::new(n));
    // Rank 2 joins, then never says anything.
    let silent = {
        let barrier = barrier.clone();
        let all_failed = all_failed.clone();
        std::thread::spawn(move || {
            let rv = rendezvous(&config(2, n, n, port).rendezvous, timeout).unwrap();
            // It takes part in the start-up handshake like any rank, then goes quiet.
            let links =
                HostTransport::connect(rv.transport, &rv.job_id, &rv.host_keys, true).unwrap();
            barrier.wait();
            all_failed.wait();
            drop(links);
        })
    };
    let mut handles = Vec::new();
    for rank in [0, 1, 3] {
        let barrier = barrier.clone();
        let all_failed = all_failed.clone();
        handles.push(std::thread::spawn(move || {
            let mut cfg = config(rank, n, n, port);
            cfg.timeout = timeout;
            let rt = Runtime::new(cfg).unwrap();
            barrier.wait();
            let err = rt
                .allreduce("x", Tensor::from_slice(&[1.0f32; 1000]), ReduceOp::Sum)
                .unwrap_err();
            // Later calls fail at once.
            let later = rt
                .allreduce("y", Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)
                .unwrap_err();
            all_failed.wait();
            (rank, err.to_string(), later)
        }));
    }
    for h in handles {
        let (rank, err, later) = h.join().unwrap();
        // Every rank names the silent one (the coordinator's verdict).
        assert!(err.contains("rank 2"), "rank {rank}: {err}");
        assert!(err.contains("rank"), "rank {rank}: {err}");
        assert!(
            matches!(later, CollectiveError::JobFailed { .. }),
            "{later}"
        );
    }
    silent.join().unwrap();
}

fn runtime_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("rw-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn control_socket_survives_malformed_clients_and_confirms_knob_changes() {
    let dir = runtime_dir("control");
    let dir2 = dir.clone();
    let results = run_job(
        2,
        2,
        Duration::from_secs(120),
        move |c| {
            c.control_socket = true;
            c.runtime_dir = Some(dir2.clone());
        },
        |rt| {
            let mut results = Vec::new();
            let check = |rt: &Runtime, i: usize| {
                let got = rt
                    .allreduce(
                        &format!("t{i}"),
                        Tensor::from_slice(&[rt.rank() as i32 + i as i32; 10]),
                        ReduceOp::Sum,
                    )
                    .unwrap();
                assert_eq!(got.to_vec::<i32>().unwrap(), vec![1 + 2 * i as i32; 10]);
            };
            check(rt, 0);
            let mut subscriber = if let Some(path) =
                rt.control_socket_path().map(|p| p.to_path_buf())
            {
                // Garbage: a frame that is not JSON.
                let mut raw = std::os::unix::net::UnixStream::connect(&path).unwrap();
                raw.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let hello: ServerMessage = read_message(&mut raw).unwrap();
                assert!(matches!(hello, ServerMessage::Hello(_)));
                std::io::Write::write_all(&mut raw, &[0, 0, 0, 3, b'{', b'x', b'}']).unwrap();
                let answer: ServerMessage = read_message(&mut raw).unwrap();
                assert!(matches!(answer, ServerMessage::Error { .. }), "{answer:?}");
                // Oversized: a length past the limit.
                let mut big = std::os::unix::net::UnixStream::connect(&path).unwrap();
                big.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let _: ServerMessage = read_message(&mut big).unwrap();
                std::io::Write::write_all(&mut big, &u32::MAX.to_be_bytes()).unwrap();
                let answer: ServerMessage = read_message(&mut big).unwrap();
                assert!(
                    matches!(&answer, ServerMessage::Error { message, .. } if message.contains("exceeds"))
                );
                // A well-behaved client, alongside a second one.
                let mut client = ControlClient::connect(&path, Duration::from_secs(60)).unwrap();
                let mut other = ControlClient::connect(&path, Duration::from_secs(60)).unwrap();
                let hello = client.hello().clone();
                assert_eq!(hello.world_size, 2);
                assert_eq!(hello.ranks.len(), 2);
                assert_eq!(hello.ranks[1].pid, std::process::id());
                client.subscribe(true, true).unwrap();
                let (knobs, _) = other.get_knobs(Duration::from_secs(60)).unwrap();
                assert_eq!(knobs, Knobs::default());
                let (knobs, applied) = client
                    .set_knobs(
                        KnobUpdate {
                            fusion_threshold_bytes: Some(4096),
                            ..Default::default()
                        },
                        Duration::from_secs(60),
                    )
                    .unwrap();
                assert_eq!(knobs.fusion_threshold_bytes, 4096);
                assert!(rt.knobs().1 >= applied);
                results.push(applied);
                write_message(&mut raw, &ClientMessage::GetKnobs { request_id: 1 }).ok();
                Some(client)
            } else {
                None
            };
            for i in 1..20 {
                check(rt, i);
            }
            if let Some(client) = &mut subscriber {
                // Statistics and timeline events of the cycles above were streamed (60 s:
                // a hang guard, as every limit of this test).
                let (mut stats, mut timeline) = (false, false);
                let deadline = Instant::now() + Duration::from_secs(60);
                while !(stats && timeline) && Instant::now() < deadline {
                    match client.next_message(Duration::from_millis(200)).unwrap() {
                        Some(ServerMessage::CycleStats(s)) => {
                            stats |= s.tensors > 0
                                && s.bytes_reduced > 0
                                && s.knobs.fusion_threshold_bytes == 4096;
                        }
                        Some(ServerMessage::Timeline { events }) => {
                            timeline |= events.iter().any(|e| e.activity == "ALLREDUCE");
                        }
                        _ => {}
                    }
                }
                assert!(stats && timeline, "stats {stats} timeline {timeline}");
            }
            // Every rank sees the new threshold (set on rank 0's socket) by now.
            assert_eq!(rt.knobs().0.fusion_threshold_bytes, 4096);
            results
        },
    );
    assert_eq!(results[0].len(), 1);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn statistics_of_fast_cycles_are_added_up_and_lose_no_byte() {
    // 2 ranks in shared memory run 3000 blocking 4 KiB allreduces, a cycle each and
    // microseconds apart, while a client on rank 0's socket reads the statistics. They
    // come at most once per STATS_EVERY_US, and together they count every byte. They
    // used to come once per cycle, hundreds of thousands a second, and the server cut
    // off a reader that fell 4 MiB behind (an agent's tuning session, once). Each call
    // is also marked as a training step: rank 0's marks all arrive, in order.
    let dir = runtime_dir("stats-rate");
    let dir2 = dir.clone();
    let calls = 3000u64;
    let out = run_job(
        2,
        2,
        Duration::from_secs(120),
        move |c| {
            c.control_socket = true;
            c.runtime_dir = Some(dir2.clone());
        },
        move |rt| {
            let mut client = rt.control_socket_path().map(|path| {
                let mut client = ControlClient::connect(path, Duration::from_secs(5)).unwrap();
                client.subscribe(true, false).unwrap();
                client
            });
            // Until rank 0's reader hears of a cycle, both ranks run 4-byte ones.
            let started = Instant::now();
            let mut warmups = 0u64;
            loop {
                let heard = client.as_mut().is_some_and(|c| {
                    matches!(
                        c.next_message(Duration::from_millis(5)).unwrap(),
                        Some(ServerMessage::CycleStats(_))
                    )
                });
                let flag = Tensor::from_slice(&[i32::from(heard)]);
                let any = rt.allreduce("subscribed", flag, ReduceOp::Sum).unwrap();
                warmups += 1;
                if any.to_vec::<i32>().unwrap()[0] > 0 {
                    break;
                }
            }
            for seed in 0..calls as usize {
                let t = input(DType::F32, rt.rank(), 1024, seed);
                let got = rt.allreduce("fast", t, ReduceOp::Sum).unwrap();
                assert_eq!(got, reference(DType::F32, ReduceOp::Sum, 2, 1024, seed));
                rt.mark_step();
            }
            // A cycle after the period sends what is held.
            std::thread::sleep(Duration::from_millis(2));
            rt.allreduce("last", Tensor::from_slice(&[1i32]), ReduceOp::Sum)
                .unwrap();
            let elapsed = started.elapsed();
            let mut client = client?;
            let (mut reports, mut bytes, mut steps) = (0u64, 0u64, 0u64);
            let mut last_mark = 0u64;
            // A hang guard: a working job has sent every report by now.
            let deadline = Instant::now() + Duration::from_secs(60);
            while (bytes < calls * 4096 || steps < calls) && Instant::now() < deadline {
                if let Some(ServerMessage::CycleStats(s)) =
                    client.next_message(Duration::from_millis(200)).unwrap()
                {
                    reports += 1;
                    bytes += s.bytes_reduced;
                    if s.steps.count > 0 {
                        assert!(
                            last_mark <= s.steps.first_unix_us
                                && s.steps.first_unix_us <= s.steps.last_unix_us,
                            "marks out of order: {:?} after {last_mark}",
                            s.steps
                        );
                        last_mark = s.steps.last_unix_us;
                    }
                    steps += s.steps.count;
                }
            }
            Some((reports, bytes, elapsed, warmups, steps))
        },
    );
    let (reports, bytes, elapsed, warmups, steps) = out[0].expect("rank 0 serves the socket");
    assert_eq!(steps, calls, "step marks reported");
    // Every 4 KiB call's bytes, and at most the 4-byte tensors around the loop: the
    // warm-ups whose reports were not read during the warm-up, and the last one. (How
    // many warm-ups it takes for the subscription to show depends on the machine's load.)
    assert!(
        calls * 4096 <= bytes && bytes <= calls * 4096 + 4 * (warmups + 1),
        "{bytes} bytes reported for {calls} calls of 4096 and {warmups} warm-ups of 4"
    );
    let bound = elapsed.as_micros() as u64 / collectives::control::STATS_EVERY_US + 3;
    assert!(
        reports <= bound,
        "{reports} reports of {calls} cycles in {elapsed:?} (at most {bound})"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn timeline_file_has_horovods_activities() {
    let dir = runtime_dir("timeline");
    let path = dir.join("timeline.json");
    let p2 = path.clone();
    run_job(
        2,
        2,
        Duration::from_secs(60),
        move |c| c.timeline_path = Some(p2.clone()),
        |rt| {
            // Fusion needs two tensors in one cycle. An idle rank starts a cycle as
            // soon as the first tensor arrives, so the first of a burst may go alone:
            // bursts of eight, a few times, as a training step's gradients come.
            for round in 0..5 {
                let handles: Vec<_> = (0..8)
                    .map(|i| {
                        rt.allreduce_async(
                            &format!("t{round}.{i}"),
                            Tensor::from_slice(&[1.0f32; 100]),
                            ReduceOp::Sum,
                        )
                        .unwrap()
                    })
                    .collect();
                for h in handles {
                    h.wait().unwrap();
                }
            }
        },
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let names: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap_or("").to_string())
        .collect();
    for activity in [
        "NEGOTIATE_ALLREDUCE",
        "QUEUE",
        "ALLREDUCE",
        "MEMCPY_IN_FUSION_BUFFER",
        "MEMCPY_OUT_FUSION_BUFFER",
    ] {
        assert!(names.iter().any(|n| n == activity), "{activity} missing");
    }
    let algo = v
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "ALLREDUCE" && e["ph"] == "B")
        .unwrap();
    // Every rank of this job shares one host: the allreduce went through shared memory.
    assert_eq!(algo["args"]["algorithm"], "shared_memory");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fusion_threshold_never_changes_a_float_result_even_in_the_last_bit() {
    // Random (not exactly representable) floats: sums round, so this checks that every
    // element is reduced in the same order whatever the fusion layout.
    let run = |threshold: u64, hierarchical: bool| {
        run_job(
            4,
            2,
            Duration::from_secs(60),
            move |c| {
                c.knobs.fusion_threshold_bytes = threshold;
                c.knobs.hierarchical_allreduce = hierarchical;
            },
            |rt| {
                let mut rng = fastrand::Rng::with_seed(rt.rank() as u64 + 1);
                let counts = [1usize, 3, 1000, 0, 4097, 17, 65_536];
                let handles: Vec<_> = counts
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| {
                        let data: Vec<f32> = (0..c).map(|_| rng.f32() * 1e3 - 5e2).collect();
                        let op = if i % 2 == 0 {
                            ReduceOp::Sum
                        } else {
                            ReduceOp::Average
                        };
                        rt.allreduce_async(&format!("f{i}"), Tensor::from_slice(&data), op)
                            .unwrap()
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.wait().unwrap())
                    .collect::<Vec<_>>()
            },
        )
    };
    for hierarchical in [false, true] {
        let unfused = run(0, hierarchical);
        for threshold in [64u64, 4096, 64 << 20] {
            let fused = run(threshold, hierarchical);
            for rank in 0..4 {
                assert!(
                    fused[rank] == unfused[rank],
                    "threshold {threshold} hierarchical {hierarchical} rank {rank}"
                );
                assert!(fused[rank] == fused[0], "ranks disagree");
            }
        }
    }
}

#[test]
fn a_steady_workload_through_the_response_cache_matches_the_reference_every_step() {
    let n = 3;
    let steps = 40;
    let run = |capacity: usize| {
        run_job(
            n,
            n,
            Duration::from_secs(120),
            move |c| c.cache_capacity = capacity,
            move |rt| {
                let rank = rt.rank();
                let mut rng = fastrand::Rng::with_seed(rank as u64 + 5);
                let mut floats = Vec::new();
                for step in 0..steps {
                    // Knob changes between steps, from a rank other than 0.
                    if rank == 1 && step % 7 == 3 {
                        rt.set_knobs(KnobUpdate {
                            fusion_threshold_bytes: Some([0u64, 256, 64 << 20][step % 3]),
                            cycle_time_us: Some([500, 1000, 2000][step % 3]),
                            ..Default::default()
                        });
                    }
                    // The same names, ops, dtypes and shapes every step (what the cache
                    // holds), new values every step.
                    let mut handles = Vec::new();
                    for k in 0..24 {
                        let (dtype, op) = (DTYPES[k % DTYPES.len()], OPS[k % OPS.len()]);
                        let count = [1usize, 7, 64, 1031][k % 4];
                        let seed = step * 24 + k;
                        let h = rt
                            .allreduce_async(
                                &format!("layer.{k}"),
                                input_for(op, dtype, rank, count, seed),
                                op,
                            )
                            .unwrap();
                        handles.push((h, reference(dtype, op, n, count, seed)));
                    }
                    // Random floats: compared bitwise with the run without the cache.
                    let data: Vec<f32> = (0..999).map(|_| rng.f32() * 1e3 - 5e2).collect();
                    let sum = rt
                        .allreduce_async("floats", Tensor::from_slice(&data), ReduceOp::Sum)
                        .unwrap();
                    for (h, expected) in handles {
                        let name = h.name().to_string();
                        let got = h.wait().unwrap();
                        assert!(got == expected, "rank {rank} step {step}: {name} is wrong");
                    }
                    floats.push(sum.wait().unwrap());
                }
                (floats, rt.totals(), rt.knobs().0)
            },
        )
    };
    let cached = run(1024);
    let by_name = run(0);
    for rank in 0..n {
        assert!(
            cached[rank].0 == by_name[rank].0,
            "rank {rank}: floats differ from the name path"
        );
        assert!(cached[rank].0 == cached[0].0, "ranks disagree");
        assert_eq!(
            cached[rank].2, cached[0].2,
            "rank {rank} ends on other knobs"
        );
    }
    assert_eq!(cached[0].2.fusion_threshold_bytes, 64 << 20); // the last change, at step 38
    // Rank 0 sees all negotiation traffic. With the cache a step's tensors are a few bits
    // each way, but 12 dtype-op pairs make 13 or more buffers a step, each with its dtype
    // and op in the response, and every cycle costs its request and response frames:
    // a quiet machine saves more than half here (resnet50 in tests/processes.rs saves
    // over 90%). How many cycles a step's tensors spread over depends on how the ranks'
    // threads are scheduled, and the cached run's bytes follow that count (nearly all
    // of them are in cycles that carry tensors) while the names dominate the other
    // run's: with two busy processes beside the suite on 2 cores the cached run took up
    // to 150 cycles instead of about 65-95, for 61% of the bytes by name instead of
    // 25-50%. So no ratio here, only that the cache saves.
    let (with_cache, without) = (
        cached[0].1.negotiation_bytes,
        by_name[0].1.negotiation_bytes,
    );
    assert!(
        with_cache < without,
        "negotiation bytes: {with_cache} with the cache, {without} without"
    );
}

#[test]
fn a_cached_tensor_whose_shape_changes_on_one_rank_mid_stream_fails_everywhere_and_the_job_goes_on()
{
    let n = 3;
    let results = run_job(
        n,
        n,
        Duration::from_secs(60),
        |c| c.cache_capacity = 64,
        move |rt| {
            let rank = rt.rank();
            let mut errors = Vec::new();
            for step in 0..12 {
                // From step 1 on, w and x are cached on every rank; at step 6 rank 1's w
                // has another shape.
                let len = if step == 6 && rank == 1 { 5 } else { 4 };
                let w = rt
                    .allreduce_async(
                        "w",
                        Tensor::from_slice(&vec![(rank + step) as f32; len]),
                        ReduceOp::Sum,
                    )
                    .unwrap();
                let x = rt
                    .allreduce_async(
                        "x",
                        Tensor::from_slice(&[(rank * step) as i64; 3]),
                        ReduceOp::Sum,
                    )
                    .unwrap();
                match w.wait() {
                    Ok(t) => {
                        let want: f32 = (0..n).map(|r| (r + step) as f32).sum();
                        assert_eq!(t.to_vec::<f32>().unwrap(), vec![want; 4], "step {step}");
                    }
                    Err(e) => errors.push((step, e)),
                }
                let want: i64 = (0..n).map(|r| (r * step) as i64).sum();
                assert_eq!(x.wait().unwrap().to_vec::<i64>().unwrap(), vec![want; 3]);
            }
            errors
        },
    );
    for (rank, errors) in results.iter().enumerate() {
        match &errors[..] {
            [(6, e)] => {
                let m = e.to_string();
                assert!(matches!(e, CollectiveError::Mismatch { .. }), "{m}");
                assert!(
                    m.contains("'w'")
                        && m.contains("[5] on ranks [1]")
                        && m.contains("[4] on ranks [0, 2]"),
                    "rank {rank}: {m}"
                );
            }
            other => panic!("rank {rank}: expected one mismatch at step 6, got {other:?}"),
        }
    }
}

#[test]
fn every_host_serves_the_jobs_socket_with_its_ranks_timeline_and_knob_changes_reach_rank_0() {
    // Two pretend hosts of two ranks each, each with its own runtime dir (its own node).
    let dir = runtime_dir("hosts");
    let dirs = [dir.join("host-a"), dir.join("host-b")];
    for d in &dirs {
        std::fs::create_dir_all(d).unwrap();
    }
    let dirs2 = dirs.clone();
    let results = run_job(
        4,
        2,
        Duration::from_secs(90),
        move |c| {
            let host = c.rendezvous.rank / 2;
            c.rendezvous.host = Some(["host-a", "host-b"][host].to_owned());
            c.control_socket = true;
            c.runtime_dir = Some(dirs2[host].clone());
        },
        |rt| {
            let rank = rt.rank();
            // Rank 2 serves host-b's socket: its hello, its claim refusal, the timeline of
            // both its host's ranks (and no other's), a knob change asked for there.
            let mut client = (rank == 2).then(|| {
                let path = rt
                    .control_socket_path()
                    .expect("host-b's first rank serves");
                let mut client = ControlClient::connect(path, Duration::from_secs(5)).unwrap();
                let hello = client.hello().clone();
                assert_eq!(hello.host.as_deref(), Some("host-b"));
                assert_eq!(hello.served_by_rank, Some(2));
                assert_eq!(hello.ranks.len(), 4);
                assert_eq!(
                    hello.local_ranks().map(|r| r.rank).collect::<Vec<_>>(),
                    vec![2, 3]
                );
                assert_eq!(hello.hosts(), vec!["host-a", "host-b"]);
                let refused = client.claim_tuning(Duration::from_secs(5)).unwrap_err();
                assert!(refused.to_string().contains("host-a"), "{refused}");
                client.subscribe(false, true).unwrap();
                client
            });
            match rank {
                0 => {
                    let path = rt.control_socket_path().expect("rank 0 serves host-a's");
                    let client = ControlClient::connect(path, Duration::from_secs(5)).unwrap();
                    assert_eq!(client.hello().host.as_deref(), Some("host-a"));
                }
                1 | 3 => assert!(rt.control_socket_path().is_none()),
                _ => {}
            }
            let mut seen = std::collections::BTreeSet::new();
            let mut applied = None;
            let deadline = Instant::now() + Duration::from_secs(60);
            for i in 0.. {
                let got = rt
                    .allreduce(
                        &format!("t{i}"),
                        Tensor::from_slice(&[rank as i32 + i; 8]),
                        ReduceOp::Sum,
                    )
                    .unwrap();
                assert_eq!(got.to_vec::<i32>().unwrap(), vec![6 + 4 * i; 8]);
                let mut done = 1;
                if let Some(client) = client.as_mut() {
                    if applied.is_none() {
                        let (knobs, at) = client
                            .set_knobs(
                                KnobUpdate {
                                    fusion_threshold_bytes: Some(12_345),
                                    ..Default::default()
                                },
                                Duration::from_secs(10),
                            )
                            .unwrap();
                        assert_eq!(knobs.fusion_threshold_bytes, 12_345);
                        applied = Some(at);
                    }
                    while let Some(message) =
                        client.next_message(Duration::from_millis(20)).unwrap()
                    {
                        if let ServerMessage::Timeline { events } = message {
                            seen.extend(events.iter().map(|e| e.rank));
                        }
                    }
                    assert!(
                        Instant::now() < deadline,
                        "host-b's timeline: ranks {seen:?}"
                    );
                    done = i32::from(seen.contains(&2) && seen.contains(&3));
                }
                // Every rank stops at the same tensor: once rank 2 has seen both.
                let flag = rt
                    .allreduce(
                        &format!("done{i}"),
                        Tensor::from_slice(&[done]),
                        ReduceOp::Min,
                    )
                    .unwrap();
                if flag.to_vec::<i32>().unwrap()[0] == 1 {
                    break;
                }
            }
            // The change asked for on host-b's socket is in force on every rank.
            assert_eq!(rt.knobs().0.fusion_threshold_bytes, 12_345);
            seen
        },
    );
    assert_eq!(results[2], [2, 3].into_iter().collect());
    std::fs::remove_dir_all(&dir).ok();
}
