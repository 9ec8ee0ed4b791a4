//! Collective schedules over a [`Transport`]: ring allreduce (reduce-scatter then allgather),
//! hierarchical allreduce, ring allgather with blocks of varying size, chain broadcast.
//!
//! These are pure schedules: which bytes go to which peer in which step. They must never
//! know about sockets, names, cycles or knobs, and must never make a rank's result depend
//! on anything but the inputs: each element is reduced by exactly one rank, in ring order,
//! and copied to the others, so every rank ends with the same bits.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{CollectiveError, Result};
use crate::tensor::{AlignedBuf, DType, ReduceOp, divide, reduce_into};
use crate::transport::Transport;

/// Which allreduce schedule ran (reported in timeline events and statistics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// One ring over all ranks.
    Ring,
    /// Intra-node reduce-scatter, cross-node ring allreduce, intra-node allgather.
    Hierarchical,
}

impl Algorithm {
    /// The name used in timeline arguments.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Hierarchical => "hierarchical",
        }
    }
}

/// How ranks are grouped into nodes: ranks `node*local_size .. (node+1)*local_size` share a
/// node, and a rank's local rank is `rank % local_size` (torchrun's and mpirun's layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeLayout {
    /// Ranks per node.
    pub local_size: usize,
    /// Number of nodes.
    pub nodes: usize,
}

impl NodeLayout {
    /// The ranks on `rank`'s node, in local-rank order.
    pub fn node_ranks(&self, rank: usize) -> Vec<usize> {
        let first = rank / self.local_size * self.local_size;
        (first..first + self.local_size).collect()
    }

    /// The ranks with the same local rank as `rank`, one per node, in node order.
    pub fn cross_ranks(&self, rank: usize) -> Vec<usize> {
        let local = rank % self.local_size;
        (0..self.nodes)
            .map(|n| n * self.local_size + local)
            .collect()
    }
}

/// Splits `count` elements into `parts` contiguous ranges whose sizes differ by at most one
/// (the first `count % parts` ranges get the extra element).
pub fn segment_bounds(count: usize, parts: usize) -> Vec<Range<usize>> {
    let base = count / parts;
    let extra = count % parts;
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

fn position(t: &dyn Transport, ranks: &[usize]) -> Result<usize> {
    ranks
        .iter()
        .position(|&r| r == t.rank())
        .ok_or_else(|| CollectiveError::Link {
            rank: t.rank(),
            peer: t.rank(),
            message: format!("rank is not a member of the group {ranks:?}"),
        })
}

/// `(&buf[a], &mut buf[b])` for disjoint byte ranges `a` and `b`.
fn split_disjoint(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    debug_assert!(a.end <= b.start || b.end <= a.start, "ranges overlap");
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

fn byte_range(r: &Range<usize>, elem: usize) -> Range<usize> {
    r.start * elem..r.end * elem
}

/// Reduce-scatter over the ring `ranks`: afterwards the rank at position `p` holds, in
/// segment `(p + 1) % n`, the reduction of that segment over all ranks, accumulated in ring
/// order starting at the segment's own position: `((x[j] ⊕ x[j+1]) ⊕ …) ⊕ x[j+n-1]`.
/// Returns the index of the segment this rank owns.
pub fn ring_reduce_scatter(
    t: &dyn Transport,
    ranks: &[usize],
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    segments: &[Range<usize>],
) -> Result<usize> {
    let n = ranks.len();
    let p = position(t, ranks)?;
    if n == 1 {
        return Ok(0);
    }
    let elem = dtype.size();
    let next = ranks[(p + 1) % n];
    let prev = ranks[(p + n - 1) % n];
    let largest = segments.iter().map(|s| s.len()).max().unwrap_or(0) * elem;
    let mut scratch = AlignedBuf::zeroed(largest);
    for step in 0..n - 1 {
        let send_idx = (p + n - step) % n;
        let recv_idx = (p + 2 * n - step - 1) % n;
        let send_range = byte_range(&segments[send_idx], elem);
        let recv_range = byte_range(&segments[recv_idx], elem);
        let recv_len = recv_range.len();
        let (send, acc) = split_disjoint(buf, send_range, recv_range);
        let incoming = &mut scratch.as_mut_slice()[..recv_len];
        t.send_recv(next, send, prev, incoming, &mut |offset, piece| {
            reduce_into(dtype, op, &mut acc[offset..offset + piece.len()], piece);
        })?;
    }
    Ok((p + 1) % n)
}

/// Ring allgather of segments: the rank at position `p` starts owning segment
/// `(p + shift) % n`; after `n - 1` steps every rank holds every segment. `segments` are
/// byte ranges of `buf`.
fn ring_pass(
    t: &dyn Transport,
    ranks: &[usize],
    buf: &mut [u8],
    segments: &[Range<usize>],
    shift: usize,
) -> Result<()> {
    let n = ranks.len();
    let p = position(t, ranks)?;
    if n == 1 {
        return Ok(());
    }
    let next = ranks[(p + 1) % n];
    let prev = ranks[(p + n - 1) % n];
    for step in 0..n - 1 {
        let send_idx = (p + shift + n - step) % n;
        let recv_idx = (p + shift + 2 * n - step - 1) % n;
        let (send, recv) =
            split_disjoint(buf, segments[send_idx].clone(), segments[recv_idx].clone());
        t.send_recv(next, send, prev, recv, &mut |_, _| {})?;
    }
    Ok(())
}

fn allreduce_over(
    t: &dyn Transport,
    ranks: &[usize],
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    divisor: usize,
) -> Result<()> {
    let elem = dtype.size();
    let count = buf.len() / elem;
    let segments = segment_bounds(count, ranks.len());
    let owned = ring_reduce_scatter(t, ranks, buf, dtype, op, &segments)?;
    if op == ReduceOp::Average {
        divide(dtype, &mut buf[byte_range(&segments[owned], elem)], divisor);
    }
    let byte_segments: Vec<Range<usize>> = segments.iter().map(|s| byte_range(s, elem)).collect();
    ring_pass(t, ranks, buf, &byte_segments, 1)
}

/// Ring allreduce of `buf` (whole elements of `dtype`) over all ranks of `t`, in place:
/// a reduce-scatter then an allgather, each step sending one segment to the next rank while
/// receiving another from the previous one, reducing received pieces as they arrive.
pub fn ring_allreduce(t: &dyn Transport, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let ranks: Vec<usize> = (0..t.world_size()).collect();
    allreduce_over(t, &ranks, buf, dtype, op, t.world_size())
}

/// Hierarchical allreduce: reduce-scatter within the node, ring allreduce of this rank's
/// segment among the ranks with the same local rank on the other nodes, allgather within
/// the node. The caller checks that `layout` describes the job (equal local sizes).
pub fn hierarchical_allreduce(
    t: &dyn Transport,
    layout: NodeLayout,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let elem = dtype.size();
    let count = buf.len() / elem;
    let node = layout.node_ranks(t.rank());
    let cross = layout.cross_ranks(t.rank());
    let segments = segment_bounds(count, node.len());
    let owned = ring_reduce_scatter(t, &node, buf, dtype, op, &segments)?;
    let owned_bytes = byte_range(&segments[owned], elem);
    allreduce_over(t, &cross, &mut buf[owned_bytes], dtype, op, t.world_size())?;
    let byte_segments: Vec<Range<usize>> = segments.iter().map(|s| byte_range(s, elem)).collect();
    ring_pass(t, &node, buf, &byte_segments, 1)
}

/// Ring allgather of blocks of varying size: `blocks[r]` is the byte range of `buf` that
/// rank `r` contributes (already filled on rank `r`); afterwards every rank has all blocks.
pub fn ring_allgather(t: &dyn Transport, buf: &mut [u8], blocks: &[Range<usize>]) -> Result<()> {
    let ranks: Vec<usize> = (0..t.world_size()).collect();
    ring_pass(t, &ranks, buf, blocks, 0)
}

/// Broadcast from `root` along the chain `root, root+1, …` (wrapping), pipelined: each rank
/// forwards a piece to the next while receiving the following one.
pub fn chain_broadcast(t: &dyn Transport, root: usize, buf: &mut [u8]) -> Result<()> {
    let n = t.world_size();
    if n == 1 {
        return Ok(());
    }
    let q = (t.rank() + n - root) % n;
    let next = (t.rank() + 1) % n;
    let prev = (t.rank() + n - 1) % n;
    if q == 0 {
        t.send(next, buf)
    } else if q == n - 1 {
        t.recv_forward(prev, None, buf)
    } else {
        t.recv_forward(prev, Some(next), buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::MemoryTransport;
    use std::time::Duration;

    /// Runs `f` on every rank of an in-memory mesh, one thread per rank.
    fn on_mesh<R: Send + 'static>(
        n: usize,
        f: impl Fn(&MemoryTransport) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let f = std::sync::Arc::new(f);
        let handles: Vec<_> = MemoryTransport::mesh(n, Duration::from_secs(10))
            .into_iter()
            .map(|t| {
                let f = f.clone();
                std::thread::spawn(move || f(&t))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn input(rank: usize, count: usize) -> Vec<f32> {
        let mut rng = fastrand::Rng::with_seed(rank as u64 * 7919 + count as u64);
        (0..count).map(|_| rng.f32() * 2.0 - 1.0).collect()
    }

    /// The ring's reduction order, computed independently: segment j is accumulated in
    /// ring positions j, j+1, …, j+n-1, left to right.
    fn ring_order_sum(inputs: &[Vec<f32>], count: usize) -> Vec<f32> {
        let n = inputs.len();
        let mut out = vec![0f32; count];
        for (j, seg) in segment_bounds(count, n).into_iter().enumerate() {
            for i in seg {
                let mut acc = inputs[j][i];
                for k in 1..n {
                    acc += inputs[(j + k) % n][i];
                }
                out[i] = acc;
            }
        }
        out
    }

    #[test]
    fn segments_cover_everything_once() {
        for (count, parts) in [(0, 3), (1, 3), (10, 3), (9, 3), (2, 8)] {
            let segs = segment_bounds(count, parts);
            assert_eq!(segs.len(), parts);
            assert_eq!(segs.iter().map(|s| s.len()).sum::<usize>(), count);
            assert!(segs.windows(2).all(|w| w[0].end == w[1].start));
        }
    }

    #[test]
    fn ring_allreduce_random_floats_matches_ring_order_bitwise_on_every_rank() {
        for n in 1..=5 {
            for count in [0, 1, 7, 100, 70_001] {
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, count)).collect();
                let expected = ring_order_sum(&inputs, count);
                let results = on_mesh(n, move |t| {
                    let mut buf = bytemuck::cast_slice::<f32, u8>(&input(t.rank(), count)).to_vec();
                    ring_allreduce(t, &mut buf, DType::F32, ReduceOp::Sum).unwrap();
                    bytemuck::pod_collect_to_vec::<u8, f32>(&buf)
                });
                for (rank, got) in results.iter().enumerate() {
                    let same = got
                        .iter()
                        .zip(&expected)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same && got.len() == count,
                        "n={n} count={count} rank={rank}"
                    );
                }
            }
        }
    }

    #[test]
    fn hierarchical_matches_exact_integer_sum() {
        for (local_size, nodes) in [(2, 2), (3, 2), (2, 3)] {
            let n = local_size * nodes;
            let count = 1001;
            let results = on_mesh(n, move |t| {
                let data: Vec<i64> = (0..count)
                    .map(|i| (i * (t.rank() + 1)) as i64 - 300)
                    .collect();
                let mut buf = bytemuck::cast_slice::<i64, u8>(&data).to_vec();
                let layout = NodeLayout { local_size, nodes };
                hierarchical_allreduce(t, layout, &mut buf, DType::I64, ReduceOp::Sum).unwrap();
                bytemuck::pod_collect_to_vec::<u8, i64>(&buf)
            });
            let expected: Vec<i64> = (0..count)
                .map(|i| (0..n).map(|r| (i * (r + 1)) as i64 - 300).sum())
                .collect();
            for got in results {
                assert_eq!(got, expected, "layout {local_size}x{nodes}");
            }
        }
    }

    #[test]
    fn allgather_with_uneven_blocks_and_broadcast_from_every_root() {
        let n = 4;
        let results = on_mesh(n, move |t| {
            let sizes = [3usize, 0, 5, 1];
            let mut blocks = Vec::new();
            let mut start = 0;
            for s in sizes {
                blocks.push(start..start + s);
                start += s;
            }
            let mut buf = vec![0u8; start];
            for b in &mut buf[blocks[t.rank()].clone()] {
                *b = t.rank() as u8 + 1;
            }
            ring_allgather(t, &mut buf, &blocks).unwrap();
            let mut bcasts = Vec::new();
            for root in 0..n {
                let mut b: Vec<u8> = if t.rank() == root {
                    (0..700_000).map(|i| (i % 251) as u8 ^ root as u8).collect()
                } else {
                    vec![0; 700_000]
                };
                chain_broadcast(t, root, &mut b).unwrap();
                bcasts.push(b);
            }
            (buf, bcasts)
        });
        for (buf, bcasts) in results {
            assert_eq!(buf, vec![1, 1, 1, 3, 3, 3, 3, 3, 4]);
            for (root, b) in bcasts.iter().enumerate() {
                assert!(
                    b.iter()
                        .enumerate()
                        .all(|(i, &v)| v == (i % 251) as u8 ^ root as u8)
                );
            }
        }
    }
}
