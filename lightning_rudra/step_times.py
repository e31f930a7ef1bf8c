"""Public path of the :class:`StepTimes` callback, kept for YAML ``class_path``\\ s
(``lightning_rudra.step_times.StepTimes``); it lives in :mod:`lightning_rudra.strategy.step_times`."""

from lightning_rudra.strategy.step_times import StepTimes

__all__ = ["StepTimes"]
