"""``python -m ringwatch.run``: PyTorch's ``torchrun``, runnable on every PyTorch ringwatch supports.

It takes torchrun's flags (``--nproc_per_node``, ``--nnodes``, ``--rdzv_endpoint``, …) and
runs ``torch.distributed.run`` in this interpreter, so that the ranks it starts import the
ringwatch installed beside it (a ``torchrun`` on ``PATH`` may belong to another Python)::

    python -m ringwatch.run --nproc_per_node 2 examples/pytorch/train.py --backend ringwatch

On PyTorch 2.x it is torchrun, unchanged. PyTorch 1.13 (Debian 12's ``python3-torch``)
crashes at start on Python 3.11 with ``AttributeError: 'NoneType' object has no attribute
'get'``: it parses its default ``--redirects 0`` by looking for the value among the members
of an ``IntFlag``, and Python 3.11 no longer lists a flag's zero member there, so the parse
gives ``None``. This launcher corrects that one parse (``0`` is ``Std.NONE``) and changes
nothing else.
"""

import sys


def _parse_zero_as_none(std):
    """Wraps ``Std.from_str`` so that a value it could not map (Python 3.11's zero flag) is
    ``Std.NONE``, as PyTorch meant; any other answer is passed through."""
    original = std.from_str

    def from_str(value):
        parsed = original(value)
        if parsed is None:
            return std.NONE
        if isinstance(parsed, dict):
            return {rank: std.NONE if v is None else v for rank, v in parsed.items()}
        return parsed

    std.from_str = staticmethod(from_str)


def main(argv=None):
    try:
        from torch.distributed import run
        from torch.distributed.elastic.multiprocessing import Std
    except ImportError as error:
        sys.exit(f"ringwatch.run: PyTorch's launcher is not importable here ({error}); "
                 "install torch into this Python first")
    _parse_zero_as_none(Std)
    run.main(argv)


if __name__ == "__main__":
    main()
