//! Collective schedules over a [`Transport`]: ring allreduce (reduce-scatter then allgather),
//! hierarchical allreduce, ring allgather with blocks of varying size, chain broadcast.
//!
//! These are pure schedules: which bytes go to which peer in which step. They must never
//! know about sockets, names, cycles or knobs, and must never make a rank's result depend
//! on anything but the inputs: each element is reduced by exactly one rank, in ring order,
//! and copied to the others, so every rank ends with the same bits.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::error::{CollectiveError, Result};
use crate::tensor::{AlignedBuf, DType, ReduceOp, divide, reduce_into, reduce_into_swapped};
use crate::transport::Transport;

/// Which allreduce schedule ran (reported in timeline events and statistics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// One ring over all ranks.
    Ring,
    /// Intra-node reduce-scatter, cross-node ring allreduce, intra-node allgather.
    Hierarchical,
    /// Every rank on one host: straight through the shared-memory segment (the flat
    /// ring's bits, without its steps).
    SharedMemory,
}

impl Algorithm {
    /// The name used in timeline arguments.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::SharedMemory => "shared_memory",
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
    (0..parts).map(|i| segment_bound(count, parts, i)).collect()
}

/// Part `i` of [`segment_bounds`]`(count, parts)`.
fn segment_bound(count: usize, parts: usize, i: usize) -> Range<usize> {
    let base = count / parts;
    let extra = count % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
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
    // Received pieces land in a small buffer that stays in cache while they are reduced.
    let piece = (PIECE_BYTES / elem * elem).max(elem);
    SCRATCH.with(|cell| {
        let mut scratch = cell.borrow_mut();
        if scratch.len() != piece {
            scratch.resize(piece);
        }
        reduce_scatter_steps(t, ranks, buf, dtype, op, segments, p, &mut scratch)
    })?;
    Ok((p + 1) % n)
}

/// Size of the piece buffer received data are reduced from: fits in a core's L2 cache.
pub const PIECE_BYTES: usize = 128 * 1024;

thread_local! {
    /// Receive buffer of the reduce-scatter, reused across calls on this thread.
    static SCRATCH: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::default());
}

#[allow(clippy::too_many_arguments)]
fn reduce_scatter_steps(
    t: &dyn Transport,
    ranks: &[usize],
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    segments: &[Range<usize>],
    p: usize,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    let n = ranks.len();
    let elem = dtype.size();
    let next = ranks[(p + 1) % n];
    let prev = ranks[(p + n - 1) % n];
    for step in 0..n - 1 {
        let send_idx = (p + n - step) % n;
        let recv_idx = (p + 2 * n - step - 1) % n;
        let send_range = byte_range(&segments[send_idx], elem);
        let recv_range = byte_range(&segments[recv_idx], elem);
        let recv_len = recv_range.len();
        let (send, acc) = split_disjoint(buf, send_range, recv_range);
        t.send_recv_pieces(
            next,
            send,
            prev,
            recv_len,
            scratch.as_mut_slice(),
            &mut |offset, piece| {
                reduce_into(dtype, op, &mut acc[offset..offset + piece.len()], piece);
            },
        )?;
    }
    Ok(())
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
    segments: &[Range<usize>],
) -> Result<()> {
    let elem = dtype.size();
    let byte_segments: SmallVec<[Range<usize>; 16]> =
        segments.iter().map(|s| byte_range(s, elem)).collect();
    // The ring's reduce-scatter computes `local ⊕ partial` at every step: the incoming
    // operand goes first (it matters for no IEEE op, but the bits are the ring's anyway).
    let combine = |acc: &mut [u8], incoming: &[u8]| reduce_into_swapped(dtype, op, acc, incoming);
    let finish = |acc: &mut [u8]| {
        if op == ReduceOp::Average {
            divide(dtype, acc, divisor);
        }
    };
    if let Some(done) = t.native_allreduce(ranks, buf, &byte_segments, &combine, &finish) {
        return done;
    }
    let owned = ring_reduce_scatter(t, ranks, buf, dtype, op, segments)?;
    finish(&mut buf[byte_segments[owned].clone()]);
    ring_pass(t, ranks, buf, &byte_segments, 1)
}

/// Ring allreduce of `buf` (whole elements of `dtype`) over all ranks of `t`, in place:
/// a reduce-scatter then an allgather, each step sending one segment to the next rank while
/// receiving another from the previous one, reducing received pieces as they arrive.
pub fn ring_allreduce(t: &dyn Transport, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let n = t.world_size();
    let ranks: SmallVec<[usize; 16]> = (0..n).collect();
    ring_allreduce_among(t, &ranks, buf, dtype, op, n)
}

/// Ring allreduce of `buf` among `ranks` only (this rank among them), in place; an
/// `Average` divides by `divisor` (the whole job's size when `ranks` reduce partial sums).
pub fn ring_allreduce_among(
    t: &dyn Transport,
    ranks: &[usize],
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    divisor: usize,
) -> Result<()> {
    // One tensor's fused layout is its own segment bounds.
    let n = ranks.len();
    let count = buf.len() / dtype.size();
    let segments: SmallVec<[Range<usize>; 16]> =
        (0..n).map(|i| segment_bound(count, n, i)).collect();
    allreduce_over(t, ranks, buf, dtype, op, divisor, &segments)
}

/// Ring allreduce of a buffer laid out by `layout` (built with `parts = world size`).
pub fn ring_allreduce_fused(
    t: &dyn Transport,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    layout: &FusedLayout,
) -> Result<()> {
    let ranks: Vec<usize> = (0..t.world_size()).collect();
    allreduce_over(t, &ranks, buf, dtype, op, t.world_size(), &layout.segments)
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
    let count = buf.len() / dtype.size();
    let fused = FusedLayout::new(&[count], layout.local_size, layout.nodes);
    hierarchical_allreduce_fused(t, layout, buf, dtype, op, &fused)
}

/// Hierarchical allreduce of a buffer laid out by `fused` (built with
/// `parts = local_size`, `sub_parts = nodes`).
pub fn hierarchical_allreduce_fused(
    t: &dyn Transport,
    layout: NodeLayout,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    fused: &FusedLayout,
) -> Result<()> {
    let elem = dtype.size();
    let node = layout.node_ranks(t.rank());
    let cross = layout.cross_ranks(t.rank());
    let segments = &fused.segments;
    let owned = ring_reduce_scatter(t, &node, buf, dtype, op, segments)?;
    let owned_bytes = byte_range(&segments[owned], elem);
    allreduce_over(
        t,
        &cross,
        &mut buf[owned_bytes],
        dtype,
        op,
        t.world_size(),
        &fused.sub_segments[owned],
    )?;
    let byte_segments: Vec<Range<usize>> = segments.iter().map(|s| byte_range(s, elem)).collect();
    ring_pass(t, &node, buf, &byte_segments, 1)
}

/// Where each tensor's elements go in a fusion buffer, so that every element is reduced in
/// exactly the order it would be if its tensor were reduced alone: each tensor is split
/// into `parts` segments (and each segment into `sub_parts` for the cross-node ring), and
/// the buffer holds segment 0 of every tensor, then segment 1 of every tensor, and so on.
/// The fusion threshold therefore never changes a result, not even in the last bit.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedLayout {
    /// Per tensor: `(element range in the tensor, element offset in the buffer)` pieces.
    pub pieces: Vec<Vec<(Range<usize>, usize)>>,
    /// Element ranges of the buffer's `parts` segments.
    pub segments: Vec<Range<usize>>,
    /// Per segment, its `sub_parts` sub-segments, relative to the segment's start.
    pub sub_segments: Vec<Vec<Range<usize>>>,
    /// Elements in the buffer.
    pub total: usize,
}

impl FusedLayout {
    /// The layout of tensors of `counts` elements for a schedule of `parts` segments, each
    /// split into `sub_parts`.
    pub fn new(counts: &[usize], parts: usize, sub_parts: usize) -> Self {
        let parts = parts.max(1);
        let sub_parts = sub_parts.max(1);
        let splits: Vec<Vec<Vec<Range<usize>>>> = counts
            .iter()
            .map(|&c| {
                segment_bounds(c, parts)
                    .into_iter()
                    .map(|seg| {
                        segment_bounds(seg.len(), sub_parts)
                            .into_iter()
                            .map(|sub| seg.start + sub.start..seg.start + sub.end)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let mut pieces = vec![Vec::new(); counts.len()];
        let mut segments = Vec::with_capacity(parts);
        let mut sub_segments = Vec::with_capacity(parts);
        let mut cursor = 0;
        for j in 0..parts {
            let seg_start = cursor;
            let mut subs = Vec::with_capacity(sub_parts);
            for c in 0..sub_parts {
                let sub_start = cursor;
                for (i, split) in splits.iter().enumerate() {
                    let src = split[j][c].clone();
                    if !src.is_empty() {
                        pieces[i].push((src.clone(), cursor));
                        cursor += src.len();
                    }
                }
                subs.push(sub_start - seg_start..cursor - seg_start);
            }
            segments.push(seg_start..cursor);
            sub_segments.push(subs);
        }
        FusedLayout {
            pieces,
            segments,
            sub_segments,
            total: cursor,
        }
    }
}

/// Which allreduce schedule to run, with what it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// One ring over all ranks.
    Ring,
    /// Intra-node, cross-node, intra-node.
    Hierarchical(NodeLayout),
}

/// Largest piece of work one ring allreduce runs at once, in bytes. Bigger tensors and
/// fused groups are reduced in slices of at most this size, one complete allreduce each,
/// so that the data a ring step touches stays in cache (NCCL slices its rings the same
/// way). A tensor's slicing depends only on the tensor, so results never depend on fusion.
pub const SLICE_BYTES: usize = 8 << 20;

/// Blocks of at least this many bytes are reduced in place, alone, instead of being packed
/// with others: copying them in and out would cost more than the latency packing saves.
pub const PACK_LIMIT_BYTES: usize = 256 << 10;

/// Copy phases reported to [`allreduce_tensors`]'s observer (for the timeline).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPhase {
    /// Starts copying a tensor's block into the fusion buffer.
    InBegin,
    /// Done copying it in.
    InEnd,
    /// Starts copying a tensor's block out of the fusion buffer.
    OutBegin,
    /// Done copying it out.
    OutEnd,
}

/// One slice: blocks `(tensor index, element range)` reduced together.
#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    /// The blocks, in buffer order.
    pub blocks: Vec<(usize, Range<usize>)>,
    /// How they are laid out and segmented.
    pub layout: FusedLayout,
}

/// Splits tensors of `counts` elements into blocks of at most `slice_elems` elements and
/// groups consecutive blocks smaller than `pack_limit_elems` into slices of at most
/// `slice_elems` elements; bigger blocks are slices of their own.
pub fn plan_slices(
    counts: &[usize],
    slice_elems: usize,
    pack_limit_elems: usize,
    parts: usize,
    sub_parts: usize,
) -> Vec<Slice> {
    let slice_elems = slice_elems.max(1);
    let mut slices = Vec::new();
    let mut current: Vec<(usize, Range<usize>)> = Vec::new();
    let mut used = 0;
    let mut close = |current: &mut Vec<(usize, Range<usize>)>, used: &mut usize| {
        if !current.is_empty() {
            let lens: Vec<usize> = current.iter().map(|(_, r)| r.len()).collect();
            slices.push(Slice {
                blocks: std::mem::take(current),
                layout: FusedLayout::new(&lens, parts, sub_parts),
            });
        }
        *used = 0;
    };
    for (i, &count) in counts.iter().enumerate() {
        let mut start = 0;
        while start < count {
            let len = slice_elems.min(count - start);
            if used + len > slice_elems || len >= pack_limit_elems {
                close(&mut current, &mut used);
            }
            current.push((i, start..start + len));
            used += len;
            if len >= pack_limit_elems {
                close(&mut current, &mut used);
            }
            start += len;
        }
    }
    close(&mut current, &mut used);
    slices
}

/// Allreduce of several tensors (`tensors[i]` holds whole elements of `dtype`) as one
/// fused operation, in slices of at most `slice_bytes`: a slice that is one block of one
/// tensor is reduced in place; other slices are packed into `fusion`, reduced and copied
/// back. `observe(tensor, phase)` hears about copies. Each element's reduction order
/// depends only on its index in its tensor, so fused and unfused results are bit-identical.
#[allow(clippy::too_many_arguments)] // each argument is a separate concern of the schedule
pub fn allreduce_tensors(
    t: &dyn Transport,
    tensors: &mut [&mut [u8]],
    dtype: DType,
    op: ReduceOp,
    schedule: Schedule,
    slice_bytes: usize,
    fusion: &mut AlignedBuf,
    observe: &mut dyn FnMut(usize, CopyPhase),
) -> Result<()> {
    let elem = dtype.size();
    // One tensor that fits in one slice, on the flat schedule (a lone blocking call, the
    // common small case): reduced in place on its own segments, which are the fused
    // layout's for one tensor, without planning slices and building the layout.
    if let ([buf], Schedule::Ring) = (&mut *tensors, schedule) {
        let count = buf.len() / elem;
        if count > 0 && count <= (slice_bytes / elem).max(1) {
            return ring_allreduce(t, buf, dtype, op);
        }
    }
    let counts: Vec<usize> = tensors.iter().map(|b| b.len() / elem).collect();
    let (parts, sub_parts) = match schedule {
        Schedule::Ring => (t.world_size(), 1),
        Schedule::Hierarchical(l) => (l.local_size, l.nodes),
    };
    let run = |buf: &mut [u8], layout: &FusedLayout| match schedule {
        Schedule::Ring => ring_allreduce_fused(t, buf, dtype, op, layout),
        Schedule::Hierarchical(l) => hierarchical_allreduce_fused(t, l, buf, dtype, op, layout),
    };
    let pack_limit = (PACK_LIMIT_BYTES / elem).min(slice_bytes / elem).max(1);
    for slice in plan_slices(
        &counts,
        (slice_bytes / elem).max(1),
        pack_limit,
        parts,
        sub_parts,
    ) {
        if let [(i, range)] = slice.blocks.as_slice() {
            run(
                &mut tensors[*i][range.start * elem..range.end * elem],
                &slice.layout,
            )?;
            continue;
        }
        let need = slice.layout.total * elem;
        if fusion.len() < need {
            // Grown, never shrunk: re-zeroing on every call costs as much as a copy.
            fusion.resize(need);
        }
        let buf = &mut fusion.as_mut_slice()[..need];
        for ((i, block), pieces) in slice.blocks.iter().zip(&slice.layout.pieces) {
            observe(*i, CopyPhase::InBegin);
            let src = &tensors[*i][block.start * elem..block.end * elem];
            for (from, to) in pieces {
                buf[to * elem..(to + from.len()) * elem]
                    .copy_from_slice(&src[from.start * elem..from.end * elem]);
            }
            observe(*i, CopyPhase::InEnd);
        }
        run(buf, &slice.layout)?;
        for ((i, block), pieces) in slice.blocks.iter().zip(&slice.layout.pieces) {
            observe(*i, CopyPhase::OutBegin);
            let dst = &mut tensors[*i][block.start * elem..block.end * elem];
            for (from, to) in pieces {
                dst[from.start * elem..from.end * elem]
                    .copy_from_slice(&buf[to * elem..(to + from.len()) * elem]);
            }
            observe(*i, CopyPhase::OutEnd);
        }
    }
    Ok(())
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
    fn a_lone_tensor_through_allreduce_tensors_has_the_ring_orders_bits() {
        // Up to one slice it skips slice planning; the reference is computed apart.
        for n in 1..=4 {
            for count in [0, 1, 7, 1000] {
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, count)).collect();
                let expected = ring_order_sum(&inputs, count);
                let results = on_mesh(n, move |t| {
                    let mut buf = bytemuck::cast_slice::<f32, u8>(&input(t.rank(), count)).to_vec();
                    let mut fusion = AlignedBuf::default();
                    allreduce_tensors(
                        t,
                        &mut [buf.as_mut_slice()],
                        DType::F32,
                        ReduceOp::Sum,
                        Schedule::Ring,
                        1000 * 4,
                        &mut fusion,
                        &mut |_, _| panic!("a lone tensor is reduced in place"),
                    )
                    .unwrap();
                    bytemuck::pod_collect_to_vec::<u8, f32>(&buf)
                });
                for (rank, got) in results.iter().enumerate() {
                    let same = got.len() == count
                        && got
                            .iter()
                            .zip(&expected)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "n={n} count={count} rank={rank}");
                }
            }
        }
    }

    /// Packs `tensors` into a buffer by `layout`, and unpacks it.
    fn pack(tensors: &[Vec<f32>], layout: &FusedLayout) -> Vec<f32> {
        let mut buf = vec![0f32; layout.total];
        for (t, pieces) in tensors.iter().zip(&layout.pieces) {
            for (src, dst) in pieces {
                buf[*dst..*dst + src.len()].copy_from_slice(&t[src.clone()]);
            }
        }
        buf
    }

    fn unpack(buf: &[f32], counts: &[usize], layout: &FusedLayout) -> Vec<Vec<f32>> {
        counts
            .iter()
            .zip(&layout.pieces)
            .map(|(&c, pieces)| {
                let mut t = vec![0f32; c];
                for (src, dst) in pieces {
                    t[src.clone()].copy_from_slice(&buf[*dst..*dst + src.len()]);
                }
                t
            })
            .collect()
    }

    #[test]
    fn fused_random_floats_are_bitwise_equal_to_each_tensor_alone_ring_and_hierarchical() {
        let counts = [13usize, 0, 1, 4099, 7];
        for (n, nodes) in [(3usize, 1usize), (4, 2), (6, 2)] {
            let results = on_mesh(n, move |t| {
                let inputs: Vec<Vec<f32>> = counts
                    .iter()
                    .map(|&c| input(t.rank() * 10 + c, c))
                    .collect();
                let local_size = n / nodes;
                let node_layout = NodeLayout { local_size, nodes };
                let run = |buf: &mut [u8], layout: &FusedLayout| {
                    if nodes == 1 {
                        ring_allreduce_fused(t, buf, DType::F32, ReduceOp::Sum, layout).unwrap()
                    } else {
                        hierarchical_allreduce_fused(
                            t,
                            node_layout,
                            buf,
                            DType::F32,
                            ReduceOp::Sum,
                            layout,
                        )
                        .unwrap()
                    }
                };
                let (parts, sub) = if nodes == 1 {
                    (n, 1)
                } else {
                    (local_size, nodes)
                };
                let layout = FusedLayout::new(&counts, parts, sub);
                let mut fused = bytemuck::cast_slice::<f32, u8>(&pack(&inputs, &layout)).to_vec();
                run(&mut fused, &layout);
                let fused = unpack(
                    &bytemuck::pod_collect_to_vec::<u8, f32>(&fused),
                    &counts,
                    &layout,
                );
                let alone: Vec<Vec<f32>> = inputs
                    .iter()
                    .map(|x| {
                        let l = FusedLayout::new(&[x.len()], parts, sub);
                        let mut b = bytemuck::cast_slice::<f32, u8>(x).to_vec();
                        run(&mut b, &l);
                        bytemuck::pod_collect_to_vec::<u8, f32>(&b)
                    })
                    .collect();
                (fused, alone)
            });
            for (fused, alone) in &results {
                for (f, a) in fused.iter().zip(alone) {
                    assert!(
                        f.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "n={n} nodes={nodes}"
                    );
                }
                assert_eq!(fused, &results[0].0, "ranks disagree");
            }
        }
    }

    #[test]
    fn sliced_fused_tensors_equal_each_tensor_alone_bitwise() {
        let counts = [130usize, 5, 0, 64, 301, 1];
        for (n, nodes) in [(3usize, 1usize), (4, 2)] {
            let results = on_mesh(n, move |t| {
                let schedule = if nodes == 1 {
                    Schedule::Ring
                } else {
                    Schedule::Hierarchical(NodeLayout {
                        local_size: n / nodes,
                        nodes,
                    })
                };
                let inputs: Vec<Vec<u8>> = counts
                    .iter()
                    .map(|&c| bytemuck::cast_slice::<f32, u8>(&input(t.rank() * 7 + c, c)).to_vec())
                    .collect();
                let mut fusion = AlignedBuf::default();
                let slice = 100 * 4;
                let mut fused = inputs.clone();
                let mut views: Vec<&mut [u8]> =
                    fused.iter_mut().map(|v| v.as_mut_slice()).collect();
                let mut copies = 0;
                allreduce_tensors(
                    t,
                    &mut views,
                    DType::F32,
                    ReduceOp::Sum,
                    schedule,
                    slice,
                    &mut fusion,
                    &mut |_, _| copies += 1,
                )
                .unwrap();
                let mut alone = inputs.clone();
                for a in &mut alone {
                    allreduce_tensors(
                        t,
                        &mut [a.as_mut_slice()],
                        DType::F32,
                        ReduceOp::Sum,
                        schedule,
                        slice,
                        &mut fusion,
                        &mut |_, _| {},
                    )
                    .unwrap();
                }
                (fused, alone, copies)
            });
            for (fused, alone, copies) in &results {
                assert_eq!(fused, alone, "n={n} nodes={nodes}");
                assert_eq!(fused, &results[0].0);
                assert!(*copies > 0, "small tensors were packed");
            }
        }
        // 130 elements in slices of 100: a full block alone, then the rest shares a slice.
        let plan = plan_slices(&[130, 5], 100, 100, 2, 1);
        assert_eq!(plan.len(), 2);
        assert_eq!(plan[0].blocks, vec![(0, 0..100)]);
        assert_eq!(plan[1].blocks, vec![(0, 100..130), (1, 0..5)]);
        // Blocks at or over the pack limit stay alone, in place.
        let plan = plan_slices(&[3, 50, 4, 2], 100, 50, 2, 1);
        let blocks: Vec<_> = plan.iter().map(|s| s.blocks.clone()).collect();
        assert_eq!(
            blocks,
            vec![
                vec![(0, 0..3)],
                vec![(1, 0..50)],
                vec![(2, 0..4), (3, 0..2)]
            ]
        );
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
