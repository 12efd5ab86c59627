"""tornado-moe: deterministic Mixture-of-Experts inference for GGUF models on NVIDIA GPUs.

One kernel set (C ABI, CPU and CUDA) reachable as torch ops and from Java; TornadoVM-style task graphs,
one per transformer layer; fused routed-expert kernels bitwise identical to per-slot ones.
"""

__version__ = "0.1.0"
