"""The tornado-moe kernels from Python: torch-op loading and one thin wrapper per kernel (see ``ops``)."""

from tornado_moe.kernels import ops
from tornado_moe.kernels.ops import *  # noqa: F403  (the wrappers; ops.__all__ is the one list)

__all__ = list(ops.__all__)
