"""Model loading: GGUF reader with validation, hyper-parameter config, tokenizer."""

from tornado_moe.model.config import SUPPORTED_ARCHS, ModelConfig
from tornado_moe.model.gguf_model import LAYER_TENSOR_NAMES, GGUFModel, QTensor, load_model

__all__ = ["SUPPORTED_ARCHS", "ModelConfig", "LAYER_TENSOR_NAMES", "GGUFModel", "QTensor", "load_model"]
