"""One exception family. Every message says what went wrong *and* what to do about it."""


class InfersightError(Exception):
    """Base of every error Infersight raises on purpose; the CLI and app show its message."""


class ModelLoadError(InfersightError):
    """A model folder or file could not be read (missing, truncated, inconsistent)."""


class UnsupportedModelError(ModelLoadError):
    """The model is readable but uses an architecture, tensor type or tokenizer we do not run."""


class InvalidRequestError(InfersightError):
    """A generation request or its parameters are out of range."""


class ModelPullError(InfersightError):
    """Fetching or converting the default model failed."""


class CancelledError(InfersightError):
    """Work was stopped on request (a load cancelled because the app is closing)."""


class OutOfMemoryError(ModelLoadError):
    """A load or a KV pool would not fit in the device's memory; the message gives the numbers
    and what would fit."""


class EngineBusyError(InfersightError):
    """The waiting queue is full; the request was not accepted."""
