"""Public path of the timing models (``RudraStrategy(simulate=λ, timing=...)``), kept for YAML ``class_path``s
such as ``lightning_rudra.timing.Stragglers``; they live in :mod:`lightning_rudra.core.timing`."""

from lightning_rudra.core.timing import (
    Homogeneous,
    Jittered,
    Measured,
    ShiftedExponential,
    Stragglers,
    TimingModel,
    push_order,
)

__all__ = ["Homogeneous", "Jittered", "Measured", "ShiftedExponential", "Stragglers", "TimingModel", "push_order"]
