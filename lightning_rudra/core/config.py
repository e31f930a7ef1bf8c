"""What the server needs to know of a run's protocol, checked: :class:`ProtocolConfig` and the validation of the
options it is built from. Plain Python."""

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.compensation import parse_compensation

PROTOCOLS = ("hardsync", "softsync", "async")
LR_MODULATIONS = ("none", "mean", "per_gradient")
NONFINITE_POLICIES = ("skip", "raise")


def _choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigurationError(f"{name}={value!r} is not supported: expected one of {', '.join(map(repr, choices))}.")


def validate_options(
    protocol: str, n: int, lr_modulation: str, max_staleness: Optional[int], nonfinite: str, compensation: str = "none"
) -> None:
    """Check the options that do not depend on the number of learners."""
    _choice("protocol", protocol, PROTOCOLS)
    _choice("lr_modulation", lr_modulation, LR_MODULATIONS)
    if "momentum" in parse_compensation(compensation) and lr_modulation != "none":
        raise ConfigurationError(
            f"lr_modulation={lr_modulation!r} and compensation={compensation!r} both scale the learning "
            "rate for staleness: use one (lr_modulation='none' with the compensation, or "
            "compensation='none' for the paper's modulation)."
        )
    _choice("nonfinite", nonfinite, NONFINITE_POLICIES)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigurationError(f"n={n!r} is not valid: the softsync splitting parameter must be an integer >= 1.")
    if max_staleness is not None and (
        isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
    ):
        raise ConfigurationError(
            f"max_staleness={max_staleness!r} is not valid: expected None (no bound) or an integer >= 0."
        )


def validate_n(protocol: str, n: int, num_learners: int) -> None:
    """n-softsync needs 1 <= n <= λ; the other protocols ignore n."""
    if protocol == "softsync" and n > num_learners:
        raise ConfigurationError(
            f"n={n} is larger than the number of learners λ={num_learners}: n-softsync needs 1 <= n <= λ "
            f"(it applies an update every ⌊λ/n⌋ gradients). Use n <= {num_learners}, or protocol='async'."
        )


@dataclass(frozen=True)
class ProtocolConfig:
    """What the server needs to know to decide when and how to apply updates."""

    num_learners: int
    protocol: str = "softsync"
    n: int = 1
    lr_modulation: str = "none"
    max_staleness: Optional[int] = None
    nonfinite: str = "skip"
    compensation: str = "none"  # see :mod:`lightning_rudra.core.compensation`
    # the learners push while their next step computes (Rudra-adv*): their own last updates may be missing from the
    # weights a gradient came from, so none of them is exempt from its staleness (core/staleness.py)
    overlap: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_learners, bool) or not isinstance(self.num_learners, int) or self.num_learners < 1:
            raise ConfigurationError(f"num_learners={self.num_learners!r} is not valid: expected an integer >= 1.")
        validate_options(
            self.protocol, self.n, self.lr_modulation, self.max_staleness, self.nonfinite, self.compensation
        )
        validate_n(self.protocol, self.n, self.num_learners)

    @property
    def gradients_per_update(self) -> int:
        """c: how many gradients one update averages (hardsync: one from every learner)."""
        if self.protocol == "async":
            return 1
        if self.protocol == "softsync":
            return self.num_learners // self.n
        return self.num_learners
