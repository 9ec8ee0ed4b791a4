//! The rings, posts, fold and waits between threads sharing a real segment.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::ShmGroup;
use super::arena::ArenaFree;
use super::layout::{
    ALIGN, ARENA_BYTES, MAX_POST_BYTES, MAX_RING_BYTES, MIN_RING_BYTES, PAGE, SEGMENT_BUDGET_BYTES,
    arena_bytes_for, free_bytes, ring_bytes_for, valid_ring_bytes,
};
use super::rings::{Incoming, Outgoing};
use super::segment::{SegmentFile, create_segment, creator_pid, map_segment};
use super::waiting::move_to_a_free_core;
use crate::error::CollectiveError;

fn group(n: usize, ring_bytes: usize, timeout: Duration) -> (SegmentFile, Vec<ShmGroup>) {
    let dir = std::env::temp_dir();
    let seg = create_segment(&dir, "unit", n, ring_bytes, 64 << 20).unwrap();
    let ranks: Vec<usize> = (10..10 + n).collect();
    let groups = (0..n)
        .map(|me| {
            map_segment(
                seg.path(),
                seg.nonce(),
                &ranks,
                me,
                ring_bytes,
                64 << 20,
                timeout,
            )
            .unwrap()
        })
        .collect();
    (seg, groups)
}

#[test]
fn an_arena_is_its_share_of_the_free_memory_up_to_the_cap() {
    // A container's 64 MiB /dev/shm for 4 ranks: 16 MiB each, whole pages.
    assert_eq!(arena_bytes_for(4, 64 << 20), 16 << 20);
    assert_eq!(arena_bytes_for(3, 64 << 20) % PAGE, 0);
    assert_eq!(arena_bytes_for(2, 1 << 40), ARENA_BYTES);
    assert_eq!(arena_bytes_for(2, 100), 0);
}

#[test]
fn an_arenas_free_ranges_join_when_given_back_in_any_order() {
    let mut free = ArenaFree::new(10 * PAGE);
    let a = free.take(2 * PAGE).unwrap();
    let b = free.take(3 * PAGE).unwrap();
    let c = free.take(PAGE).unwrap();
    assert_eq!((a, b, c), (0, 2 * PAGE, 5 * PAGE));
    assert_eq!(free.take(5 * PAGE), None, "4 pages are left");
    free.give(a, 2 * PAGE);
    free.give(c, PAGE);
    assert_eq!(free.ranges, vec![0..2 * PAGE, 5 * PAGE..10 * PAGE]);
    free.give(b, 3 * PAGE);
    assert_eq!(free.ranges, vec![0..10 * PAGE]);
    assert_eq!(free.take(10 * PAGE), Some(0));
    assert!(free.ranges.is_empty());
}

/// `err` is member 0 (rank 10) giving up on member 1 (rank 11).
fn assert_times_out_naming_rank_11(err: &CollectiveError) {
    assert!(
        matches!(
            err,
            CollectiveError::PeerTimeout {
                rank: 10,
                peer: 11,
                ..
            }
        ),
        "{err}"
    );
}

fn never_gone(_: usize) -> bool {
    false
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(seed).wrapping_add((i >> 8) as u8))
        .collect()
}

#[test]
fn messages_of_odd_sizes_cross_a_small_ring_intact_and_in_order() {
    let (_seg, mut g) = group(2, 4096, Duration::from_secs(10));
    let b = g.pop().unwrap();
    let a = g.pop().unwrap();
    let sizes = [1usize, 63, 64, 65, 4000, 4096, 10_000, 3, 70_000];
    std::thread::scope(|s| {
        s.spawn(|| {
            for (i, &n) in sizes.iter().enumerate() {
                let data = pattern(n, i as u8 + 1);
                a.exchange(Some((1, Outgoing::new(&data))), None, None, &never_gone)
                    .unwrap();
            }
        });
        for (i, &n) in sizes.iter().enumerate() {
            let mut buf = vec![0u8; n];
            b.exchange(
                None,
                Some((0, Incoming::copy(&mut buf, 1000, None))),
                None,
                &never_gone,
            )
            .unwrap();
            assert_eq!(buf, pattern(n, i as u8 + 1), "message {i} of {n} bytes");
        }
    });
}

#[test]
fn a_receive_may_span_several_sends() {
    let (_seg, mut g) = group(2, 8192, Duration::from_secs(10));
    let b = g.pop().unwrap();
    let a = g.pop().unwrap();
    let whole = pattern(30_000, 7);
    std::thread::scope(|s| {
        s.spawn(|| {
            for part in whole.chunks(7001) {
                a.exchange(Some((1, Outgoing::new(part))), None, None, &never_gone)
                    .unwrap();
            }
        });
        let mut buf = vec![0u8; whole.len()];
        let mut chunks = Vec::new();
        let mut cb = |off: usize, bytes: &[u8]| chunks.push((off, bytes.len()));
        b.exchange(
            None,
            Some((0, Incoming::copy(&mut buf, 4096, Some(&mut cb)))),
            None,
            &never_gone,
        )
        .unwrap();
        assert_eq!(buf, whole);
        let expected: Vec<(usize, usize)> = (0..whole.len())
            .step_by(4096)
            .map(|o| (o, 4096.min(whole.len() - o)))
            .collect();
        assert_eq!(chunks, expected);
    });
}

#[test]
fn full_duplex_exchange_larger_than_the_rings_both_ways() {
    // Both ranks send 3 MiB through 64 KiB rings before either finishes receiving:
    // only a truly interleaved exchange gets through.
    let (_seg, mut g) = group(2, 64 * 1024, Duration::from_secs(10));
    let b = g.pop().unwrap();
    let a = g.pop().unwrap();
    let size = 3 << 20;
    let run = |t: &ShmGroup, me: usize, seed: u8| {
        let peer = 1 - me;
        let send = pattern(size, seed);
        let mut recv = vec![0u8; size];
        t.exchange(
            Some((peer, Outgoing::new(&send))),
            Some((peer, Incoming::copy(&mut recv, 1 << 20, None))),
            None,
            &never_gone,
        )
        .unwrap();
        recv
    };
    let (ra, rb) = std::thread::scope(|s| {
        let ha = s.spawn(|| run(&a, 0, 3));
        let rb = run(&b, 1, 5);
        (ha.join().unwrap(), rb)
    });
    assert_eq!(ra, pattern(size, 5));
    assert_eq!(rb, pattern(size, 3));
}

#[test]
fn pieces_come_straight_from_the_ring_when_whole_and_are_gathered_otherwise() {
    let ring = 64 * 1024;
    let (_seg, mut g) = group(2, ring, Duration::from_secs(10));
    let b = g.pop().unwrap();
    let a = g.pop().unwrap();
    let piece = 16 * 1024;
    // A leading odd-sized message shifts later pieces so that some straddle the end of
    // the ring; every byte must still arrive, in order, in pieces of `piece` bytes.
    let lead = pattern(100, 1);
    let data = pattern(300_000, 9);
    std::thread::scope(|s| {
        s.spawn(|| {
            a.exchange(Some((1, Outgoing::new(&lead))), None, None, &never_gone)
                .unwrap();
            a.exchange(Some((1, Outgoing::new(&data))), None, None, &never_gone)
                .unwrap();
        });
        let mut head = vec![0u8; lead.len()];
        b.exchange(
            None,
            Some((0, Incoming::copy(&mut head, 4096, None))),
            None,
            &never_gone,
        )
        .unwrap();
        assert_eq!(head, lead);
        let mut piece_buf = vec![0u8; piece];
        let mut got = vec![0u8; data.len()];
        let mut in_place = 0;
        let mut seen = Vec::new();
        let base = b.map.as_ptr() as usize;
        let end = base + b.layout.total();
        let mut on_piece = |off: usize, bytes: &[u8]| {
            let p = bytes.as_ptr() as usize;
            if (base..end).contains(&p) {
                in_place += 1;
                assert_eq!(p % ALIGN, 0, "pieces handed in place are aligned");
            }
            seen.push((off, bytes.len()));
            got[off..off + bytes.len()].copy_from_slice(bytes);
        };
        b.exchange(
            None,
            Some((
                0,
                Incoming::pieces(data.len(), &mut piece_buf, &mut on_piece),
            )),
            None,
            &never_gone,
        )
        .unwrap();
        assert_eq!(got, data);
        let expected: Vec<(usize, usize)> = (0..data.len())
            .step_by(piece)
            .map(|o| (o, piece.min(data.len() - o)))
            .collect();
        assert_eq!(seen, expected);
        assert!(
            in_place >= expected.len() / 2,
            "{in_place} of {} in place",
            expected.len()
        );
        assert!(
            in_place < expected.len(),
            "some pieces straddle the ring's end"
        );
    });
}

#[test]
fn posts_agree_only_when_every_member_posts_the_same_bytes_round_after_round() {
    let n = 3;
    let (_seg, g) = group(n, 4096, Duration::from_secs(10));
    let members: Vec<usize> = (0..n).collect();
    // Round r: everyone posts the same bytes, except that in every third round the
    // last member changes one byte, and in every fifth it posts a shorter message.
    // Lengths vary from round to round, so a post shorter than the last one in the
    // same buffer must not pass for it.
    let post = |r: usize, m: usize| {
        let mut p = pattern(1 + (r * 37) % MAX_POST_BYTES, r as u8 + 1);
        if m == n - 1 && r % 3 == 1 {
            let at = r % p.len();
            p[at] ^= 1;
        }
        if m == n - 1 && r % 5 == 4 {
            p.pop();
        }
        p
    };
    let rounds = 200;
    let answers: Vec<Vec<bool>> = std::thread::scope(|s| {
        let threads: Vec<_> = g
            .iter()
            .enumerate()
            .map(|(m, group)| {
                let members = &members;
                s.spawn(move || {
                    (0..rounds)
                        .map(|r| group.same_posts(members, &post(r, m), &never_gone).unwrap())
                        .collect::<Vec<bool>>()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let expected: Vec<bool> = (0..rounds).map(|r| post(r, 0) == post(r, n - 1)).collect();
    assert!(expected.iter().any(|&e| e) && expected.iter().any(|&e| !e));
    for (m, got) in answers.iter().enumerate() {
        assert_eq!(got, &expected, "member {m}");
    }
    let too_long = vec![0u8; MAX_POST_BYTES + 1];
    assert!(g[0].same_posts(&members, &too_long, &never_gone).is_err());
}

#[test]
fn a_member_waiting_for_a_post_is_woken_by_one_and_otherwise_gives_up_at_its_deadline() {
    let (_seg, g) = group(2, 4096, Duration::from_secs(10));
    let members = [0, 1];
    let started = Instant::now();
    let deadline = started + Duration::from_millis(50);
    assert!(!g[1].wait_for_a_post(&members, deadline).unwrap());
    assert!(Instant::now() >= deadline);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(30);
            let posted = g[1].wait_for_a_post(&members, deadline).unwrap();
            // Back before its deadline: woken by the post, not by giving up.
            assert!(Instant::now() < deadline);
            // It joins the round it was woken for.
            let same = g[1].same_posts(&members, b"x", &never_gone).unwrap();
            (posted, same)
        });
        std::thread::sleep(Duration::from_millis(20));
        assert!(g[0].same_posts(&members, b"x", &never_gone).unwrap());
        assert_eq!(waiter.join().unwrap(), (true, true));
    });
    // Nothing posted beyond the rounds both took part in.
    let deadline = Instant::now() + Duration::from_millis(20);
    assert!(!g[0].wait_for_a_post(&members, deadline).unwrap());
}

#[test]
fn a_post_nobody_answers_times_out_naming_the_silent_member() {
    let (_seg, g) = group(2, 4096, Duration::from_millis(200));
    let err = g[0].same_posts(&[0, 1], b"ready", &never_gone).unwrap_err();
    assert_times_out_naming_rank_11(&err);
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let (_seg, g) = group(2, 4096, Duration::from_millis(200));
    let mut buf = [0u8; 8];
    let started = Instant::now();
    let err = g[0]
        .exchange(
            None,
            Some((1, Incoming::copy(&mut buf, 8, None))),
            None,
            &never_gone,
        )
        .unwrap_err();
    // A hang guard, not a bound on how long past its timeout a loaded machine takes:
    // the error's kind shows that the wait timed out.
    assert!(started.elapsed() < Duration::from_secs(60));
    assert_times_out_naming_rank_11(&err);
}

#[test]
fn a_peers_abort_or_death_ends_the_wait_at_once_naming_it() {
    let timeout = Duration::from_secs(60);
    let (_seg, g) = group(3, 4096, timeout);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let mut buf = [0u8; 8];
            let started = Instant::now();
            let err = g[0]
                .exchange(
                    None,
                    Some((1, Incoming::copy(&mut buf, 8, None))),
                    None,
                    &never_gone,
                )
                .unwrap_err();
            (err, started.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        g[1].abort();
        let (err, waited) = waiter.join().unwrap();
        // Not the timeout: the abort ended it (the error's kind says so too, a link
        // error rather than a timeout), however late a loaded machine ran the waiter.
        assert!(waited < timeout, "{waited:?}");
        assert!(
            matches!(
                err,
                CollectiveError::Link {
                    rank: 10,
                    peer: 11,
                    ..
                }
            ),
            "{err}"
        );
    });
    // A peer whose process is gone (as the TCP link reports) is named too.
    let gone = |r: usize| r == 12;
    let mut buf = [0u8; 8];
    let err = g[0]
        .exchange(
            None,
            Some((2, Incoming::copy(&mut buf, 8, None))),
            None,
            &gone,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            CollectiveError::Link {
                rank: 10,
                peer: 12,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn ring_size_shrinks_with_more_members_and_less_free_space() {
    let plenty = 1 << 40;
    // m(m-1) rings plus 2m allreduce slots of the same size.
    assert_eq!(ring_bytes_for(2, plenty), Some(MAX_RING_BYTES));
    assert_eq!(ring_bytes_for(4, plenty), Some(MAX_RING_BYTES)); // 20 of them, 160 MiB
    assert_eq!(ring_bytes_for(8, plenty), Some(2 << 20)); // 72, 144 MiB
    assert_eq!(ring_bytes_for(16, plenty), Some(512 << 10)); // 272, 136 MiB
    // Docker's default 64 MiB /dev/shm: 4 ranks get 1 MiB (20 MiB in all).
    assert_eq!(ring_bytes_for(4, 64 << 20), Some(1 << 20));
    assert_eq!(ring_bytes_for(4, 1 << 20), None);
    for m in 2..40 {
        if let Some(r) = ring_bytes_for(m, plenty) {
            assert!(valid_ring_bytes(r));
            assert!(r * m * (m + 1) <= SEGMENT_BUDGET_BYTES);
        }
    }
    assert!(!valid_ring_bytes(3 << 20) && !valid_ring_bytes(64 << 20));
    assert!(free_bytes(std::path::Path::new("/")).unwrap() > 0);
}

#[test]
fn a_segment_left_by_a_dead_creator_is_removed_and_a_live_ones_kept() {
    let dir = std::env::temp_dir().join(format!("rw-shm-orphans-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // pid_max is at most 2^22: this pid cannot be running.
    let dead = dir.join("ringwatch-job-a-99999999-00000000deadbeef");
    let alive = dir.join(format!(
        "ringwatch-job-a-{}-00000000deadbeef",
        std::process::id()
    ));
    let unrelated = dir.join("ringwatch-notes-99999999-x");
    for p in [&dead, &alive, &unrelated] {
        std::fs::write(p, b"x").unwrap();
    }
    assert_eq!(
        creator_pid("ringwatch-job-a-99999999-00000000deadbeef"),
        Some(99_999_999)
    );
    let seg = create_segment(&dir, "job", 2, MIN_RING_BYTES, 0).unwrap();
    assert!(!dead.exists());
    assert!(alive.exists() && unrelated.exists() && seg.path().exists());
    drop(seg);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The calling thread's affinity mask, as the cores in it.
fn allowed_cores() -> Vec<usize> {
    // SAFETY: as in `move_to_a_free_core`.
    unsafe {
        let mut mask: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut mask),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &mask))
            .collect()
    }
}

#[test]
fn a_rank_moves_to_a_core_nobody_took_and_keeps_its_affinity_mask() {
    std::thread::spawn(|| {
        let allowed = allowed_cores();
        if allowed.len() < 2 {
            eprintln!("one core allowed: nowhere to move to, nothing to check");
            return;
        }
        // SAFETY: no arguments.
        let here = unsafe { libc::sched_getcpu() } as u32;
        // Every other allowed core taken: it stays.
        let others: Vec<u32> = allowed
            .iter()
            .map(|&c| c as u32)
            .filter(|&c| c != here)
            .collect();
        assert_eq!(move_to_a_free_core(here, &others), None);
        assert_eq!(allowed_cores(), allowed);
        // One free: it goes there, and its mask is what it was.
        let free = others[0];
        let taken: Vec<u32> = others[1..].to_vec();
        let moved = move_to_a_free_core(here, &taken).expect("a move to the free core");
        assert_eq!(moved.to, free);
        // Where it ran while pinned there: once its mask is back, a loaded machine's
        // scheduler may move it again at any time.
        assert_eq!(moved.pinned_on, Some(free));
        assert_eq!(allowed_cores(), allowed);
    })
    .join()
    .unwrap();
}

#[test]
fn members_on_one_core_see_it_shared_and_the_later_one_leaves() {
    std::thread::spawn(|| {
        let (_seg, mut groups) = group(2, MIN_RING_BYTES, Duration::from_secs(5));
        let allowed = allowed_cores();
        if allowed.len() < 2 || !groups[0].spread {
            eprintln!("one core allowed: no core of its own for each member, nothing to check");
            return;
        }
        // Longer than any pause a loaded machine puts between two calls below.
        groups[1].move_every = Duration::from_secs(60);
        // The members are told which core they are on (as `leave_a_shared_core` reads
        // it): a loaded machine may move this thread between any two lines.
        // SAFETY: no arguments.
        let here = unsafe { libc::sched_getcpu() } as u32;
        let elsewhere = allowed
            .iter()
            .map(|&c| c as u32)
            .find(|&c| c != here)
            .unwrap();
        let publish =
            |member: usize, cpu: u32| groups[0].bell(member).cpu.store(cpu + 1, Ordering::Relaxed);
        // Member 1 last waited elsewhere: member 0 has this core to itself.
        publish(1, elsewhere);
        assert!(!groups[0].leave_a_shared_core_at(here));
        // Member 1 last waited here: member 0 shares the core and, as the earlier of
        // the two, stays (its waits spin less meanwhile).
        publish(1, here);
        assert!(groups[0].leave_a_shared_core_at(here));
        assert_eq!(groups[0].bell(0).cpu.load(Ordering::Relaxed), here + 1);
        // Member 1, on the core member 0 published, is the later one: it moves to a
        // core nobody waited on, says so at once, and has a core of its own.
        assert!(!groups[1].leave_a_shared_core_at(here));
        let moved_to = groups[0].bell(1).cpu.load(Ordering::Relaxed) - 1;
        assert_ne!(moved_to, here);
        // Within its `move_every` it does not move again, though member 0 waits on
        // its new core now.
        publish(0, moved_to);
        assert!(
            groups[1].leave_a_shared_core_at(moved_to),
            "moved again within move_every"
        );
        assert_eq!(allowed_cores(), allowed);
    })
    .join()
    .unwrap();
}

#[test]
fn a_segment_that_is_not_the_announced_one_is_refused() {
    let seg = create_segment(&std::env::temp_dir(), "unit", 2, 4096, PAGE).unwrap();
    let err = map_segment(
        seg.path(),
        seg.nonce() ^ 2,
        &[0, 1],
        1,
        4096,
        PAGE,
        Duration::from_secs(1),
    )
    .unwrap_err();
    assert!(err.contains("not the segment"), "{err}");
    let err = map_segment(
        seg.path(),
        seg.nonce(),
        &[0, 1, 2],
        1,
        4096,
        PAGE,
        Duration::from_secs(1),
    )
    .unwrap_err();
    assert!(err.contains("expected"), "{err}");
    // Arenas of another size than announced: refused too.
    let err = map_segment(
        seg.path(),
        seg.nonce(),
        &[0, 1],
        1,
        4096,
        2 * PAGE,
        Duration::from_secs(1),
    )
    .unwrap_err();
    assert!(err.contains("expected"), "{err}");
    let path = seg.path().to_path_buf();
    drop(seg);
    assert!(!path.exists(), "the creator removes the file");
}
