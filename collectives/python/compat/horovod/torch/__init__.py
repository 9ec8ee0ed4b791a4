"""``import horovod.torch as hvd`` running :mod:`ringwatch.torch`.

Names only: every name is ringwatch's own; nothing here implements a collective or
anything else, so what Horovod has and ringwatch lacks is missing here too
(``AttributeError``)."""

from ringwatch.torch import *  # noqa: F401,F403
from ringwatch.torch import __all__  # noqa: F401
