"""TM_Q8_0_TILED: Q8_0 rows re-laid out at upload so the GPU reads them with 8- and 16-byte loads.

A Q8_0 block is 34 bytes (fp16 scale, 32 int8 codes), so inside a row nothing is more than 2-byte aligned and
the CUDA dot product reads a row as 16-bit words: three load instructions per lane for every 4 values, too few
bytes in flight per register to keep HBM busy. Tiling moves the bytes within each row (same row size, same
values) so that a lane finds the codes and scales of 4 consecutive dot-product steps in one 16-byte and one
8-byte word (layout: ``csrc/include/tornado_moe.h``, ``TM_Q8_0_TILED``); the bytes themselves are the file's,
the int8 codes as they are (the GPU's DP4A takes them signed). The kernels feed the same values to the same
arithmetic in the same order, so every result is bitwise the one the GGUF layout gives. It is an in-memory
layout of the engine, never written to a file.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tornado_moe.quant.formats import QuantType

__all__ = ["Q8_0_TILED", "TILE_VALUES", "can_tile", "tile_q8_0", "tiled_source_bytes", "untile_q8_0"]

#: The C ABI's qtype id of the layout (not a GGML type id: GGML's stop below 64).
Q8_0_TILED = 264
#: A tiled row holds a multiple of this many values (whole steps of 4 blocks of 32).
TILE_VALUES = 128


def can_tile(qtype: int, cols: int) -> bool:
    """Whether rows of ``cols`` values of ``qtype`` have a tiled layout (Q8_0, cols a multiple of 128)."""
    return int(qtype) == QuantType.Q8_0 and cols > 0 and cols % TILE_VALUES == 0


@functools.lru_cache(maxsize=16)
def tiled_source_bytes(cols: int) -> np.ndarray:
    """For each byte j of a tiled row of ``cols`` values, the index of the Q8_0 row byte that goes there.

    Written from the layout's description (lane l of step s owns codes 4(l % 8)..+3 of block 4s + l // 8;
    steps in groups of 4, the last group holding the rest), independently of the C helpers it is tested
    against.
    """
    if cols % TILE_VALUES != 0:
        raise ValueError(f"Q8_0_TILED rows hold a multiple of {TILE_VALUES} values, not {cols}")
    nb = cols // 32
    steps = cols // TILE_VALUES
    full_groups = steps // 4
    c = np.arange(cols, dtype=np.int64)
    b, i = c // 32, c % 32
    s = b // 4
    g, u = s // 4, s % 4
    width = np.where(g < full_groups, 4, steps % 4)
    lane = 8 * (b % 4) + i // 4
    src = np.empty(34 * nb, dtype=np.int64)
    src[512 * g + 4 * (width * lane + u) + i % 4] = 34 * b + 2 + i
    blk = np.arange(nb, dtype=np.int64)
    sb = blk // 4
    gb, ub = sb // 4, sb % 4
    wb = np.where(gb < full_groups, 4, steps % 4)
    scale = cols + 32 * gb + 2 * (wb * (blk % 4) + ub)
    src[scale] = 34 * blk
    src[scale + 1] = 34 * blk + 1
    return src


def _rows(data: torch.Tensor, cols: int) -> torch.Tensor:
    """``data`` as a [rows, row bytes] view, after checking that it holds whole uint8 Q8_0 rows."""
    row_bytes = 34 * cols // 32
    if data.dtype != torch.uint8 or data.numel() % row_bytes != 0:
        raise ValueError(f"expected uint8 Q8_0 rows of {row_bytes} bytes, got {data.dtype} x {data.numel()}")
    return data.reshape(-1, row_bytes)


def _permute_rows(data: torch.Tensor, cols: int, index: np.ndarray) -> torch.Tensor:
    return _rows(data, cols).index_select(1, torch.from_numpy(index).to(data.device)).reshape(data.shape)


def tile_q8_0(data: torch.Tensor, cols: int) -> torch.Tensor:
    """The Q8_0 rows ``data`` (uint8, any shape holding whole rows of ``cols`` values) in the tiled layout.

    A new tensor on ``data``'s device, of the same shape and size: each row's bytes, moved.
    """
    return _permute_rows(data, cols, tiled_source_bytes(cols))


def untile_q8_0(data: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of :func:`tile_q8_0` (tiled rows back to GGUF Q8_0 bytes)."""
    return _permute_rows(data, cols, np.argsort(tiled_source_bytes(cols)))
