"""Exception hierarchy of tornado-moe.

Every error the package raises on purpose derives from :class:`TornadoMoeError`, so a caller (the CLI,
a test, a user script) can tell "the engine refused this input, with a message that says why" apart from
a bug. Messages name the file, tensor, key or argument at fault.
"""

from __future__ import annotations

__all__ = ["TornadoMoeError", "ModelFileError", "UnsupportedModelError", "InputError", "DeviceError"]


class TornadoMoeError(Exception):
    """Base class of every deliberate tornado-moe error."""


class ModelFileError(TornadoMoeError):
    """The model file is unusable: not a GGUF, truncated, a tensor or key missing, or a wrong shape."""


class UnsupportedModelError(TornadoMoeError):
    """The file is a valid GGUF but uses an architecture, quantization type or feature we do not run."""


class InputError(TornadoMoeError):
    """Bad user input: prompt longer than the context, text for a model without tokenizer, bad ids..."""


class DeviceError(TornadoMoeError):
    """The requested device cannot be used (e.g. CUDA asked for but not available)."""
