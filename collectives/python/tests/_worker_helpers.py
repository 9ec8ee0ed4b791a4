"""What the worker scripts of the bit-for-bit tests share (pasted into them after
``rw.init()`` and ``r, n = rw.rank(), rw.size()``): the dtypes, small-integer inputs, the
bitwise comparison and the reference reductions, and a failure list."""

WORKER_HELPERS = r"""
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
        torch.bfloat16: torch.int16, torch.int32: torch.int32, torch.int64: torch.int64}

def inputs(rank, dtype, shape):
    # Small integers: exact in every dtype, so any summation order gives the same bits.
    numel = 1
    for d in shape:
        numel *= d
    base = torch.arange(numel, dtype=torch.int64).reshape(shape)
    return ((base * 7 + rank * 13) % 23 - 11).to(dtype)

def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(BITS[a.dtype]), b.contiguous().view(BITS[b.dtype]))

def reference(everyone, op, dtype):
    if op == rw.Sum:
        return everyone.sum(0).to(dtype)
    if op == rw.Average:
        if dtype.is_floating_point:
            return (everyone.to(torch.float64).sum(0) / n).to(dtype)
        return torch.div(everyone.sum(0), n, rounding_mode="trunc").to(dtype)
    if op == rw.Min:
        return everyone.min(0).values
    return everyone.max(0).values

failures = []
def check(ok, what):
    if not ok:
        failures.append(what)

"""
