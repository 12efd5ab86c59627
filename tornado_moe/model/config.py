"""Model hyper-parameters, independent of where they were read from.

Every other part of tornado-moe (reference model, graph builders, kernels, synthetic writers) sizes its
buffers and picks its semantics (RoPE style, top-k renormalisation, shared expert) from this one object.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelConfig", "SUPPORTED_ARCHS", "QK_NORMS"]

SUPPORTED_ARCHS: tuple[str, ...] = ("qwen2moe", "qwen3moe", "olmoe", "llama")
QK_NORMS: tuple[str, ...] = ("", "head", "full")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer with a dense or Mixture-of-Experts FFN.

    Field semantics:
      - ``neox_rope``: True rotates pairs (i, i + d/2) (qwen2moe, qwen3moe, olmoe); False rotates interleaved
        pairs (2i, 2i+1), the layout GGUF ``llama`` files store their permuted Q/K rows in.
      - ``n_experts`` = 0 means a dense FFN of size ``dense_ffn``; otherwise ``top_k`` experts of size
        ``expert_ffn`` are routed per token and ``shared_ffn`` (> 0 for qwen2moe) is the gated shared expert.
      - ``normalize_topk``: whether the selected softmax probabilities are renormalised to sum to 1
        (False for qwen2moe and olmoe, True for qwen3moe and Mixtral-style llama files).
      - ``qk_norm``: the RMSNorm q and k get before RoPE: ``""`` none, ``"head"`` one per head (weights of
        ``head_dim``; qwen3moe), ``"full"`` one over all of q (weights of ``q_dim``) and one over all of k
        (``kv_dim``; olmoe).
      - ``tied_output``: the file has no ``output.weight``; logits use ``token_embd.weight``.
    """

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float
    neox_rope: bool
    n_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    dense_ffn: int
    normalize_topk: bool
    qkv_bias: bool
    tied_output: bool
    qk_norm: str = ""

    def __post_init__(self) -> None:
        # Catch inconsistent configs at construction: everything downstream trusts these invariants.
        problems = []
        if self.arch not in SUPPORTED_ARCHS:
            problems.append(f"arch {self.arch!r} not in {SUPPORTED_ARCHS}")
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab", "context_length"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads != 0:
            problems.append(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2 != 0:
            problems.append(f"head_dim {self.head_dim} must be even for RoPE")
        if self.n_experts > 0:
            if not 0 < self.top_k <= self.n_experts:
                problems.append(f"top_k {self.top_k} must be in 1..n_experts ({self.n_experts})")
            if self.expert_ffn <= 0:
                problems.append("expert_ffn must be > 0 for an MoE model")
            if self.dense_ffn != 0:
                problems.append("dense_ffn must be 0 for an MoE model")
        else:
            if self.top_k != 0 or self.expert_ffn != 0 or self.shared_ffn != 0:
                problems.append("a dense model (n_experts 0) must have top_k, expert_ffn, shared_ffn all 0")
            if self.dense_ffn <= 0:
                problems.append("dense_ffn must be > 0 for a dense model")
        if self.qk_norm not in QK_NORMS:
            problems.append(f"qk_norm {self.qk_norm!r} not in {QK_NORMS}")
        if self.rms_eps <= 0 or self.rope_theta <= 0:
            problems.append("rms_eps and rope_theta must be > 0")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def is_moe(self) -> bool:
        """True when the FFN is a Mixture of Experts."""
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        """Rows of attn_q: n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Rows of attn_k / attn_v: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def qk_norm_widths(self) -> tuple[int, int]:
        """Values one RMSNorm of q and one of k cover (their weights' lengths): a head's (``"head"``), all of
        q's and all of k's (``"full"``); (0, 0) without q/k norms."""
        widths = {"": (0, 0), "head": (self.head_dim, self.head_dim), "full": (self.q_dim, self.kv_dim)}
        return widths[self.qk_norm]

    def describe(self) -> str:
        """One-line human summary, e.g. for logs and the CLI banner."""
        attn = f"{self.n_heads}h/{self.n_kv_heads}kv x {self.head_dim}"
        if self.is_moe:
            ffn = f"{self.n_experts} experts top-{self.top_k} x {self.expert_ffn}"
            if self.shared_ffn:
                ffn += f" + shared {self.shared_ffn}"
            ffn += ", renormalised" if self.normalize_topk else ", not renormalised"
        else:
            ffn = f"dense ffn {self.dense_ffn}"
        return (
            f"{self.arch}: {self.n_layers} layers, hidden {self.hidden}, attn {attn}"
            f"{' +qkv bias' if self.qkv_bias else ''}{f' +qk norm ({self.qk_norm})' if self.qk_norm else ''}"
            f", {ffn}, vocab {self.vocab}, ctx {self.context_length}, "
            f"rope {'neox' if self.neox_rope else 'normal'} theta {self.rope_theta:g}, eps {self.rms_eps:g}"
            f"{', tied output' if self.tied_output else ''}"
        )
