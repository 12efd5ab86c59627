"""GGML quantization formats: block sizes, numpy dequantization (the oracle) and quantization."""

from tornado_moe.quant.formats import (
    FLOAT_TYPES,
    QuantType,
    block_size,
    dequantize,
    quant_type_of,
    quantize,
    row_bytes,
    type_size,
)

__all__ = [
    "FLOAT_TYPES",
    "QuantType",
    "block_size",
    "dequantize",
    "quant_type_of",
    "quantize",
    "row_bytes",
    "type_size",
]
