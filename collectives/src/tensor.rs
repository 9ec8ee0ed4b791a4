//! Tensors as the runtime sees them: a dtype, a shape and 8-byte-aligned bytes, plus the
//! element-wise reductions.
//!
//! Reductions here are pure and deterministic: one call combines two buffers element by
//! element, nothing else. This module must never decide an order of reduction across ranks;
//! the algorithms do, so that every rank gets the same bits.

use serde::{Deserialize, Serialize};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE half precision (through the `half` crate; reduced in f32, rounded once per step).
    F16,
    /// bfloat16 (through the `half` crate; reduced in f32, rounded once per step).
    BF16,
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 32-bit signed integer (sums wrap on overflow).
    I32,
    /// 64-bit signed integer (sums wrap on overflow).
    I64,
    /// 8-bit unsigned integer (sums and products wrap on overflow).
    U8,
    /// 8-bit signed integer (sums and products wrap on overflow).
    I8,
    /// 16-bit signed integer (sums and products wrap on overflow).
    I16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// Whether it is an integer type (an average truncates).
    pub fn is_integer(self) -> bool {
        matches!(
            self,
            DType::I32 | DType::I64 | DType::U8 | DType::I8 | DType::I16
        )
    }
}

/// Reduction applied by allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the world size (integers: truncating division).
    Average,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Element-wise product (integers wrap on overflow).
    Product,
}

/// A Rust element type that maps to a [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync {
    /// The dtype of this element type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i8 {
    const DTYPE: DType = DType::I8;
}
impl Element for i16 {
    const DTYPE: DType = DType::I16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

/// A byte buffer whose start is 8-byte aligned, so it can be viewed as any [`DType`].
#[derive(Clone, Default, PartialEq)]
pub struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        AlignedBuf {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut buf = Self::zeroed(bytes.len());
        buf.as_mut_slice().copy_from_slice(bytes);
        buf
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// Grows or shrinks to `len` bytes, keeping the prefix; new bytes are zero.
    pub fn resize(&mut self, len: usize) {
        self.words.resize(len.div_ceil(8), 0);
        self.len = len;
    }
}

/// Memory a tensor borrows from its caller (a framework's tensor, e.g. PyTorch's), read and
/// written in place, with the object that keeps it alive. See [`Tensor::from_external`].
pub struct ExternalBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// Dropped with the tensor, after the runtime's last access to `ptr`.
    _owner: Box<dyn Send>,
}

// SAFETY: `from_external`'s contract gives the tensor exclusive use of the memory until it
// is dropped, so moving it to the runtime's thread moves that exclusive use with it.
unsafe impl Send for ExternalBuf {}

impl ExternalBuf {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `from_external`'s contract: valid for `len` bytes, used by nobody else.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Where a tensor's bytes live.
enum Storage {
    /// A buffer of the runtime's own.
    Owned(AlignedBuf),
    /// The caller's memory, used in place (no copy in, no copy out).
    External(ExternalBuf),
}

impl Storage {
    fn as_slice(&self) -> &[u8] {
        match self {
            Storage::Owned(b) => b.as_slice(),
            Storage::External(b) => b.as_slice(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Storage::Owned(b) => b.as_mut_slice(),
            Storage::External(b) => b.as_mut_slice(),
        }
    }
}

/// A dense tensor: dtype, shape (row-major) and its bytes, either its own or (see
/// [`Tensor::from_external`]) borrowed from the caller. Cloning copies the bytes into a
/// tensor of its own.
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    data: Storage,
}

impl Clone for Tensor {
    fn clone(&self) -> Self {
        Tensor {
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: Storage::Owned(AlignedBuf::from_bytes(self.as_bytes())),
        }
    }
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.as_bytes() == other.as_bytes()
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let storage = match self.data {
            Storage::Owned(_) => "owned",
            Storage::External(_) => "external",
        };
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.byte_len())
            .field("storage", &storage)
            .finish()
    }
}

impl Tensor {
    /// A tensor from typed elements; `data.len()` must equal the product of `shape`.
    pub fn new<T: Element>(shape: &[usize], data: &[T]) -> Option<Self> {
        let count: usize = shape.iter().product();
        if count != data.len() {
            return None;
        }
        Some(Tensor {
            dtype: T::DTYPE,
            shape: shape.to_vec(),
            data: Storage::Owned(AlignedBuf::from_bytes(bytemuck::cast_slice(data))),
        })
    }

    /// A one-dimensional tensor from typed elements.
    pub fn from_slice<T: Element>(data: &[T]) -> Self {
        Tensor {
            dtype: T::DTYPE,
            shape: vec![data.len()],
            data: Storage::Owned(AlignedBuf::from_bytes(bytemuck::cast_slice(data))),
        }
    }

    /// A tensor from raw bytes; `None` unless the length matches shape and dtype.
    pub fn from_bytes(dtype: DType, shape: &[usize], data: AlignedBuf) -> Option<Self> {
        let count: usize = shape.iter().product();
        if count * dtype.size() != data.len() {
            return None;
        }
        Some(Tensor {
            dtype,
            shape: shape.to_vec(),
            data: Storage::Owned(data),
        })
    }

    /// A tensor over the caller's memory, which the runtime reads its input from and writes
    /// its result to in place (allreduce and broadcast; allgather returns a tensor of its
    /// own). `owner` is dropped with the tensor: hand it whatever keeps the memory alive
    /// (for PyTorch, a reference to the tensor). `None` unless `len` matches shape and dtype.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until `owner` is dropped, and
    /// nothing else may read or write those bytes while the returned tensor (or a result
    /// made from it) lives. A `len` of 0 never touches `ptr`.
    pub unsafe fn from_external(
        dtype: DType,
        shape: &[usize],
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Send>,
    ) -> Option<Self> {
        let count: usize = shape.iter().product();
        if count.checked_mul(dtype.size()) != Some(len) {
            return None;
        }
        let ptr = match std::ptr::NonNull::new(ptr) {
            Some(p) => p,
            None if len == 0 => std::ptr::NonNull::dangling(),
            None => return None,
        };
        Some(Tensor {
            dtype,
            shape: shape.to_vec(),
            data: Storage::External(ExternalBuf {
                ptr,
                len,
                _owner: owner,
            }),
        })
    }

    /// Whether the bytes are the caller's (see [`Tensor::from_external`]).
    pub fn is_external(&self) -> bool {
        matches!(self.data, Storage::External(_))
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.as_bytes().len()
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.data.as_mut_slice()
    }

    /// The elements as `T`; `None` if `T` is not this tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Option<Vec<T>> {
        if T::DTYPE != self.dtype {
            return None;
        }
        Some(bytemuck::pod_collect_to_vec(self.as_bytes()))
    }

    /// Takes the underlying buffer (a copy, for a tensor over the caller's memory).
    pub fn into_buf(self) -> AlignedBuf {
        match self.data {
            Storage::Owned(b) => b,
            Storage::External(b) => AlignedBuf::from_bytes(b.as_slice()),
        }
    }
}

fn combine<const SWAP: bool, T: bytemuck::Pod>(
    acc: &mut [u8],
    incoming: &[u8],
    f: impl Fn(T, T) -> T,
) {
    let f = |a: T, b: T| if SWAP { f(b, a) } else { f(a, b) };
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(acc),
        bytemuck::try_cast_slice::<u8, T>(incoming),
    ) {
        (Ok(a), Ok(b)) => fold_elements(a, b, f),
        _ => {
            // Unaligned views (never produced by this crate's buffers, but allowed).
            let size = std::mem::size_of::<T>();
            for (x, y) in acc.chunks_exact_mut(size).zip(incoming.chunks_exact(size)) {
                let v = f(
                    bytemuck::pod_read_unaligned(x),
                    bytemuck::pod_read_unaligned(y),
                );
                x.copy_from_slice(bytemuck::bytes_of(&v));
            }
        }
    }
}

/// `a[i] = f(a[i], b[i])` for every element, compiled for AVX2 too and run that way
/// where the CPU has it (std caches the check): the baseline x86-64 build folds 4
/// `f32` at a time (SSE2), AVX2 8. Every element is computed alone, by the same `f`,
/// so the bits do not depend on the vector width.
#[inline(always)]
fn fold_elements<T: Copy>(a: &mut [T], b: &[T], f: impl Fn(T, T) -> T) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        unsafe { fold_elements_avx2(a, b, f) };
        return;
    }
    fold_elements_plain(a, b, f);
}

#[inline(always)]
fn fold_elements_plain<T: Copy>(a: &mut [T], b: &[T], f: impl Fn(T, T) -> T) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = f(*x, *y);
    }
}

/// [`fold_elements_plain`] compiled with AVX2 (the loop is inlined here).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fold_elements_avx2<T: Copy>(a: &mut [T], b: &[T], f: impl Fn(T, T) -> T) {
    fold_elements_plain(a, b, f);
}

fn map_in_place<T: bytemuck::Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(a) => a.iter_mut().for_each(|x| *x = f(*x)),
        Err(_) => {
            let size = std::mem::size_of::<T>();
            for x in buf.chunks_exact_mut(size) {
                let v = f(bytemuck::pod_read_unaligned(x));
                x.copy_from_slice(bytemuck::bytes_of(&v));
            }
        }
    }
}

/// `acc[i] = acc[i] ⊕ incoming[i]` for every element. `Average` combines as `Sum`; the
/// division happens once, in [`divide`]. Both slices must hold whole elements of `dtype`.
pub fn reduce_into(dtype: DType, op: ReduceOp, acc: &mut [u8], incoming: &[u8]) {
    reduce_impl::<false>(dtype, op, acc, incoming)
}

/// `acc[i] = incoming[i] ⊕ acc[i]`: the operands of [`reduce_into`] swapped, for schedules
/// that must apply the ring's exact operand order from the other side.
pub fn reduce_into_swapped(dtype: DType, op: ReduceOp, acc: &mut [u8], incoming: &[u8]) {
    reduce_impl::<true>(dtype, op, acc, incoming)
}

fn reduce_impl<const SWAP: bool>(dtype: DType, op: ReduceOp, acc: &mut [u8], incoming: &[u8]) {
    debug_assert_eq!(acc.len(), incoming.len());
    use half::{bf16, f16};
    match (dtype, op) {
        (DType::F32, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, f32>(acc, incoming, |a, b| a + b)
        }
        (DType::F32, ReduceOp::Min) => combine::<SWAP, f32>(acc, incoming, f32::min),
        (DType::F32, ReduceOp::Max) => combine::<SWAP, f32>(acc, incoming, f32::max),
        (DType::F32, ReduceOp::Product) => combine::<SWAP, f32>(acc, incoming, |a, b| a * b),
        (DType::F64, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, f64>(acc, incoming, |a, b| a + b)
        }
        (DType::F64, ReduceOp::Min) => combine::<SWAP, f64>(acc, incoming, f64::min),
        (DType::F64, ReduceOp::Max) => combine::<SWAP, f64>(acc, incoming, f64::max),
        (DType::F64, ReduceOp::Product) => combine::<SWAP, f64>(acc, incoming, |a, b| a * b),
        (DType::I32, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, i32>(acc, incoming, i32::wrapping_add)
        }
        (DType::I32, ReduceOp::Min) => combine::<SWAP, i32>(acc, incoming, std::cmp::min),
        (DType::I32, ReduceOp::Max) => combine::<SWAP, i32>(acc, incoming, std::cmp::max),
        (DType::I32, ReduceOp::Product) => combine::<SWAP, i32>(acc, incoming, i32::wrapping_mul),
        (DType::I64, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, i64>(acc, incoming, i64::wrapping_add)
        }
        (DType::I64, ReduceOp::Min) => combine::<SWAP, i64>(acc, incoming, std::cmp::min),
        (DType::I64, ReduceOp::Max) => combine::<SWAP, i64>(acc, incoming, std::cmp::max),
        (DType::I64, ReduceOp::Product) => combine::<SWAP, i64>(acc, incoming, i64::wrapping_mul),
        (DType::U8, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, u8>(acc, incoming, u8::wrapping_add)
        }
        (DType::U8, ReduceOp::Min) => combine::<SWAP, u8>(acc, incoming, std::cmp::min),
        (DType::U8, ReduceOp::Max) => combine::<SWAP, u8>(acc, incoming, std::cmp::max),
        (DType::U8, ReduceOp::Product) => combine::<SWAP, u8>(acc, incoming, u8::wrapping_mul),
        (DType::I8, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, i8>(acc, incoming, i8::wrapping_add)
        }
        (DType::I8, ReduceOp::Min) => combine::<SWAP, i8>(acc, incoming, std::cmp::min),
        (DType::I8, ReduceOp::Max) => combine::<SWAP, i8>(acc, incoming, std::cmp::max),
        (DType::I8, ReduceOp::Product) => combine::<SWAP, i8>(acc, incoming, i8::wrapping_mul),
        (DType::I16, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, i16>(acc, incoming, i16::wrapping_add)
        }
        (DType::I16, ReduceOp::Min) => combine::<SWAP, i16>(acc, incoming, std::cmp::min),
        (DType::I16, ReduceOp::Max) => combine::<SWAP, i16>(acc, incoming, std::cmp::max),
        (DType::I16, ReduceOp::Product) => combine::<SWAP, i16>(acc, incoming, i16::wrapping_mul),
        (DType::F16, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, f16>(acc, incoming, |a, b| f16::from_f32(a.to_f32() + b.to_f32()))
        }
        (DType::F16, ReduceOp::Min) => combine::<SWAP, f16>(acc, incoming, f16::min),
        (DType::F16, ReduceOp::Max) => combine::<SWAP, f16>(acc, incoming, f16::max),
        (DType::F16, ReduceOp::Product) => {
            combine::<SWAP, f16>(acc, incoming, |a, b| f16::from_f32(a.to_f32() * b.to_f32()))
        }
        (DType::BF16, ReduceOp::Sum | ReduceOp::Average) => {
            combine::<SWAP, bf16>(acc, incoming, |a, b| {
                bf16::from_f32(a.to_f32() + b.to_f32())
            })
        }
        (DType::BF16, ReduceOp::Min) => combine::<SWAP, bf16>(acc, incoming, bf16::min),
        (DType::BF16, ReduceOp::Max) => combine::<SWAP, bf16>(acc, incoming, bf16::max),
        (DType::BF16, ReduceOp::Product) => combine::<SWAP, bf16>(acc, incoming, |a, b| {
            bf16::from_f32(a.to_f32() * b.to_f32())
        }),
    }
}

/// Divides every element by `divisor` (the last step of `Average`; integers truncate).
pub fn divide(dtype: DType, buf: &mut [u8], divisor: usize) {
    use half::{bf16, f16};
    if divisor <= 1 {
        return;
    }
    match dtype {
        DType::F32 => map_in_place::<f32>(buf, |x| x / divisor as f32),
        DType::F64 => map_in_place::<f64>(buf, |x| x / divisor as f64),
        DType::I32 => map_in_place::<i32>(buf, |x| x / divisor as i32),
        DType::I64 => map_in_place::<i64>(buf, |x| x / divisor as i64),
        // The divisor is the job's size; past the type's range every quotient is 0 (or,
        // for i8/i16, 0 as well: |x| < divisor).
        DType::U8 => map_in_place::<u8>(buf, |x| u8::try_from(divisor).map_or(0, |d| x / d)),
        DType::I8 => map_in_place::<i8>(buf, |x| i8::try_from(divisor).map_or(0, |d| x / d)),
        DType::I16 => map_in_place::<i16>(buf, |x| i16::try_from(divisor).map_or(0, |d| x / d)),
        DType::F16 => map_in_place::<f16>(buf, |x| f16::from_f32(x.to_f32() / divisor as f32)),
        DType::BF16 => map_in_place::<bf16>(buf, |x| bf16::from_f32(x.to_f32() / divisor as f32)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_integers_wrap_and_products_keep_the_sign_of_zero() {
        let mut acc = Tensor::from_slice(&[250u8, 3, 0]);
        reduce_into(
            DType::U8,
            ReduceOp::Sum,
            acc.as_bytes_mut(),
            Tensor::from_slice(&[10u8, 4, 255]).as_bytes(),
        );
        assert_eq!(acc.to_vec::<u8>().unwrap(), vec![4, 7, 255]);
        divide(DType::U8, acc.as_bytes_mut(), 2);
        assert_eq!(acc.to_vec::<u8>().unwrap(), vec![2, 3, 127]);
        let mut acc = Tensor::from_slice(&[-128i8, 5, -3]);
        reduce_into(
            DType::I8,
            ReduceOp::Min,
            acc.as_bytes_mut(),
            Tensor::from_slice(&[127i8, -5, 2]).as_bytes(),
        );
        assert_eq!(acc.to_vec::<i8>().unwrap(), vec![-128, -5, -3]);
        let mut acc = Tensor::from_slice(&[300i16, -7, 2]);
        reduce_into(
            DType::I16,
            ReduceOp::Product,
            acc.as_bytes_mut(),
            Tensor::from_slice(&[300i16, 3, -2]).as_bytes(),
        );
        // 90,000 wraps to 90,000 − 65,536·1 = 24,464.
        assert_eq!(acc.to_vec::<i16>().unwrap(), vec![24_464, -21, -4]);
        divide(DType::I16, acc.as_bytes_mut(), 1 << 20);
        assert_eq!(acc.to_vec::<i16>().unwrap(), vec![0, 0, 0]);
        let mut acc = Tensor::from_slice(&[0.0f32, -2.0, 1.5]);
        reduce_into(
            DType::F32,
            ReduceOp::Product,
            acc.as_bytes_mut(),
            Tensor::from_slice(&[-3.0f32, -0.5, 2.0]).as_bytes(),
        );
        let got = acc.to_vec::<f32>().unwrap();
        assert_eq!(got, vec![-0.0, 1.0, 3.0]);
        assert!(got[0].is_sign_negative(), "0 × −3 is −0");
    }

    #[test]
    fn reduce_each_op_on_i32() {
        let mut acc = Tensor::from_slice(&[1i32, 5, -3]);
        let inc = Tensor::from_slice(&[2i32, 4, -7]);
        let mut sum = acc.clone();
        reduce_into(
            DType::I32,
            ReduceOp::Sum,
            sum.as_bytes_mut(),
            inc.as_bytes(),
        );
        assert_eq!(sum.to_vec::<i32>().unwrap(), vec![3, 9, -10]);
        let mut min = acc.clone();
        reduce_into(
            DType::I32,
            ReduceOp::Min,
            min.as_bytes_mut(),
            inc.as_bytes(),
        );
        assert_eq!(min.to_vec::<i32>().unwrap(), vec![1, 4, -7]);
        reduce_into(
            DType::I32,
            ReduceOp::Max,
            acc.as_bytes_mut(),
            inc.as_bytes(),
        );
        assert_eq!(acc.to_vec::<i32>().unwrap(), vec![2, 5, -3]);
        divide(DType::I32, sum.as_bytes_mut(), 2);
        assert_eq!(sum.to_vec::<i32>().unwrap(), vec![1, 4, -5]);
    }

    #[test]
    fn unaligned_views_reduce_like_aligned_ones() {
        let a: Vec<f64> = vec![1.5, -2.25, 3.0];
        let b: Vec<f64> = vec![0.5, 0.25, -1.0];
        let mut raw = [0u8; 1 + 24];
        raw[1..].copy_from_slice(bytemuck::cast_slice(&a));
        reduce_into(
            DType::F64,
            ReduceOp::Sum,
            &mut raw[1..],
            bytemuck::cast_slice(&b),
        );
        let got: Vec<f64> = bytemuck::pod_collect_to_vec(&raw[1..]);
        assert_eq!(got, vec![2.0, -2.0, 2.0]);
    }

    #[test]
    fn tensor_rejects_wrong_length() {
        assert!(Tensor::new(&[2, 3], &[1.0f32; 5]).is_none());
        assert!(Tensor::new(&[2, 0], &[] as &[f32]).is_some());
        assert!(Tensor::from_slice(&[1.0f32]).to_vec::<f64>().is_none());
    }
}
