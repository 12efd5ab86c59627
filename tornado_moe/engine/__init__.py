"""Decode engine: device weights, per-layer task graphs, KV cache and generation."""

from tornado_moe.engine.engine import Engine, EngineOptions, GenerationStats, resolve_device
from tornado_moe.engine.layer_graphs import SamplerConfig

__all__ = ["Engine", "EngineOptions", "GenerationStats", "SamplerConfig", "resolve_device"]
