"""Float64 reference implementation of the supported models (the test oracle)."""

from tornado_moe.reference.model64 import KVCache, ReferenceModel, rmsnorm, rope, route_topk

__all__ = ["KVCache", "ReferenceModel", "rmsnorm", "rope", "route_topk"]
