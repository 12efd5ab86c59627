"""SentencePiece BPE encoding, for GGUF files whose ``tokenizer.ggml.model`` is ``"llama"`` (the Llama 2,
Mistral and Mixtral vocabularies), as sentencepiece's and llama.cpp's encoders do it.

The text arrives with its spaces already escaped to U+2581 (``ESCAPED_SPACE``). It starts as one symbol per
character; then the adjacent pair whose concatenation is a vocabulary piece with the highest score is merged,
ties to the leftmost pair, until no adjacent pair forms a piece. A symbol left that is no piece (a character
outside the vocabulary) becomes its UTF-8 bytes as ``<0xXX>`` byte pieces, or the unknown piece where the
vocabulary has no byte pieces. Only normal pieces take part in merges: control, unknown, byte and unused ones
never do (special tokens are matched whole in the text before this, by the caller).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

__all__ = ["SpmEncoder", "ESCAPED_SPACE"]

ESCAPED_SPACE = "\u2581"


class SpmEncoder:
    """Encoder over ``pieces`` (the vocabulary's strings) and their ``scores``.

    ``mergeable[i]`` says whether piece i may be formed by a merge (normal pieces); ``byte_ids`` maps a byte
    value to its ``<0xXX>`` piece; ``unk_id`` is the unknown piece, used for bytes without a piece.
    """

    def __init__(self, pieces: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool],
                 byte_ids: Mapping[int, int], unk_id: int | None) -> None:
        if not len(pieces) == len(scores) == len(mergeable):
            raise ValueError(f"{len(pieces)} pieces, {len(scores)} scores, {len(mergeable)} flags")
        self._index: dict[str, int] = {}
        for i, p in enumerate(pieces):
            if mergeable[i]:
                self._index.setdefault(p, i)  # duplicated strings: the lowest id wins
        self._scores = [float(s) for s in scores]
        self._byte_ids = dict(byte_ids)
        self._unk_id = unk_id

    def encode(self, text: str) -> list[int]:
        """Piece ids of ``text`` (spaces escaped by the caller)."""
        n = len(text)
        if n == 0:
            return []
        start = list(range(n))
        size = [1] * n  # characters a symbol spans; 0 once merged into its left neighbour
        prev = list(range(-1, n - 1))
        nxt = [*range(1, n), -1]
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, characters of the pair)

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            piece_id = self._index.get(text[start[left]:start[right] + size[right]])
            if piece_id is not None:
                heapq.heappush(heap, (-self._scores[piece_id], left, right, size[left] + size[right]))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, pair_size = heapq.heappop(heap)
            # stale: a side was merged away, or grew since this pair was queued
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != pair_size:
                continue
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        out: list[int] = []
        i = 0
        while i >= 0:
            symbol = text[start[i]:start[i] + size[i]]
            piece_id = self._index.get(symbol)
            if piece_id is not None:
                out.append(piece_id)
            else:  # a character outside the vocabulary (merged symbols are always pieces)
                for b in symbol.encode("utf-8"):
                    fallback = self._byte_ids.get(b, self._unk_id)
                    if fallback is None:
                        raise ValueError(f"character {symbol!r} has no piece, byte piece or unknown piece")
                    out.append(fallback)
            i = nxt[i]
        return out
