"""ringwatch: a Horovod-style collective runtime (Rust) that the ringwatch agent watches
and tunes live.

The PyTorch front end is ``ringwatch.torch``::

    import ringwatch.torch as rw
    rw.init()
    optimizer = rw.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    rw.broadcast_parameters(model.state_dict(), root_rank=0)
"""

from ringwatch._native import (
    MismatchError,
    NotInitializedError,
    RankFailedError,
    RingwatchError,
)

__all__ = ["RingwatchError", "MismatchError", "RankFailedError", "NotInitializedError"]
