"""The layerwise worker's own error."""

from kvo_core.errors import KvoError


class PipelineError(KvoError, RuntimeError):
    """The per-layer pipeline was driven out of order or could not finish a layer in time."""
