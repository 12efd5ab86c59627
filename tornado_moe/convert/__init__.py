"""Converters that write GGUF files tornado-moe (and llama.cpp) can load."""

from tornado_moe.convert.hf_to_gguf import (
    hf_config_to_model_config,
    permute_for_interleaved_rope,
    write_gguf,
    write_hf_model_to_gguf,
)

__all__ = [
    "hf_config_to_model_config",
    "permute_for_interleaved_rope",
    "write_gguf",
    "write_hf_model_to_gguf",
]
