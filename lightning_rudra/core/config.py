"""What the server needs to know of a run's protocol, checked: :class:`ProtocolConfig` and the validation of the
options it is built from. Plain Python."""

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.compensation import parse_compensation

PROTOCOLS = ("hardsync", "softsync", "async", "batchsync")
OVERLAP_BLOCKS = (
    "on_stale='block' is not available with overlap=True: a learner computes its next step before its push is "
    "answered, so holding its push back does not hold back the weights it computes on. Use overlap=False with "
    "on_stale='block', or on_stale='drop'."
)
LR_MODULATIONS = ("none", "mean", "per_gradient")
NONFINITE_POLICIES = ("skip", "raise")
ON_STALE = ("drop", "block")


def _choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigurationError(f"{name}={value!r} is not supported: expected one of {', '.join(map(repr, choices))}.")


def validate_options(  # 7 params: the rule's options as the user gave them
    protocol: str,
    n: int,
    lr_modulation: str,
    max_staleness: Optional[int],
    nonfinite: str,
    compensation: str = "none",
    on_stale: str = "drop",
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
    if n > 1 and protocol != "softsync":
        # the default protocol was 1-softsync in 0.1.0: RudraStrategy(n=2) would otherwise be async without a word
        raise ConfigurationError(
            f"n={n} is softsync's splitting parameter, and protocol={protocol!r} has none. For {n}-softsync, pass "
            f"protocol='softsync', n={n}; for {protocol}, leave n unset (the default protocol is 'async'; it was "
            "1-softsync in 0.1.0)."
        )
    if max_staleness is not None and (
        isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
    ):
        raise ConfigurationError(
            f"max_staleness={max_staleness!r} is not valid: expected None (no bound) or an integer >= 0."
        )
    _choice("on_stale", on_stale, ON_STALE)
    if on_stale == "block" and max_staleness is None:
        raise ConfigurationError(
            "on_stale='block' needs a bound to keep: max_staleness=None keeps every gradient whatever its staleness. "
            "Set max_staleness=s (σ <= s), or leave on_stale='drop'."
        )
    if on_stale == "block" and protocol == "hardsync":
        raise ConfigurationError(
            f"on_stale='block' with max_staleness={max_staleness} has nothing to block under protocol='hardsync': "
            "every gradient is applied with σ = 0. Leave on_stale='drop', or use protocol='async' or 'softsync'."
        )


def validate_rounds(  # 7 params: the round's options and those they cannot go with
    protocol: str,
    k: Optional[int],
    backup: int,
    num_learners: Optional[int] = None,
    max_staleness: Optional[int] = None,
    on_stale: str = "drop",
    overlap: bool = False,
) -> None:
    """K-batch-sync's ``k`` and hardsync's ``backup`` (:mod:`lightning_rudra.core.rounds`), checked with the options
    they cannot go with; ``num_learners``: λ once it is known."""
    if k is not None:
        if protocol != "batchsync":
            raise ConfigurationError(
                f"k={k!r} is K-batch-sync's round size and has no meaning with protocol={protocol!r}. Use "
                "protocol='batchsync' (an update after the first k gradients of the current weights), or leave k unset."
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigurationError(
                f"k={k!r} is not valid: expected an integer >= 1, the gradients of the current weights each update "
                "averages (None: λ, one per learner)."
            )
    if isinstance(backup, bool) or not isinstance(backup, int) or backup < 0:
        raise ConfigurationError(
            f"backup={backup!r} is not valid: expected an integer >= 0, the learners a hardsync round does not wait "
            "for (0: it waits for every learner)."
        )
    if backup and protocol != "hardsync":
        raise ConfigurationError(
            f"backup={backup} is for protocol='hardsync' (a round takes the first λ - backup learners' gradients), "
            f"not {protocol!r}. Use protocol='hardsync', or protocol='batchsync' with k for a round of any learners' "
            "gradients."
        )
    if num_learners is not None and backup >= num_learners:
        raise ConfigurationError(
            f"backup={backup} with λ={num_learners} learners leaves no learner for a round to wait for: expected "
            f"0 <= backup < {num_learners}."
        )
    if protocol != "batchsync" and not backup:
        return
    name = "protocol='batchsync'" if protocol == "batchsync" else f"backup={backup}"
    if max_staleness is not None or on_stale != "drop":
        raise ConfigurationError(
            f"max_staleness={max_staleness!r}, on_stale={on_stale!r} has nothing to bound with {name}: every gradient "
            "it applies comes from the current weights (σ = 0), and a later one is not applied. Leave max_staleness "
            "and on_stale unset."
        )
    if overlap:
        raise ConfigurationError(
            f"overlap=True is not available with {name}: a learner would compute its next gradient before its push "
            "is answered, on weights the round may already have left, and its gradient would not be applied. Use "
            "overlap=False."
        )


def min_blocking_staleness(protocol: str, n: int, num_learners: int) -> int:
    """The smallest max_staleness that on_stale='block' can keep with λ learners: an update applies c gradients,
    and a gradient handed the newest weights may follow the λ - 1 gradients of weights no newer, in the update
    open now (up to c - 1 already in it) and the next ones, so σ reaches ⌊(λ + c - 2) / c⌋ whatever the order."""
    c = ProtocolConfig(num_learners, protocol, n).gradients_per_update
    return (num_learners + c - 2) // c


def validate_blocking(protocol: str, n: int, max_staleness: Optional[int], on_stale: str, num_learners: int) -> None:
    """on_stale='block' with λ learners needs max_staleness >= :func:`min_blocking_staleness`."""
    if on_stale != "block" or max_staleness is None or protocol == "hardsync":
        return
    least = min_blocking_staleness(protocol, n, num_learners)
    if max_staleness < least:
        rule = "async" if protocol == "async" else f"{n}-softsync"
        raise ConfigurationError(
            f"max_staleness={max_staleness} with on_stale='block' cannot be kept by {rule} with λ={num_learners} "
            f"learners: each update applies c={ProtocolConfig(num_learners, protocol, n).gradients_per_update} "
            f"gradient(s), and the learners' gradients computed on the same or older weights wait before the newest, "
            f"so σ reaches {least} whatever the server holds back. Use max_staleness >= {least}, fewer learners, "
            + ("protocol='softsync' (1-softsync needs max_staleness >= 1)" if protocol == "async" else "a smaller n")
            + ", or on_stale='drop'."
        )


def validate_n(protocol: str, n: int, num_learners: int) -> None:
    """n-softsync needs 1 <= n <= λ (the other protocols refuse n > 1: :func:`validate_options`)."""
    if protocol == "softsync" and n > num_learners:
        raise ConfigurationError(
            f"n={n} is larger than the number of learners λ={num_learners}: n-softsync needs 1 <= n <= λ "
            f"(it applies an update every ⌊λ/n⌋ gradients). Use n <= {num_learners}, or protocol='async' without n."
        )


@dataclass(frozen=True)
class ProtocolConfig:
    """What the server needs to know to decide when and how to apply updates."""

    num_learners: int
    protocol: str = "async"
    n: int = 1
    lr_modulation: str = "none"
    max_staleness: Optional[int] = None
    nonfinite: str = "skip"
    compensation: str = "none"  # see :mod:`lightning_rudra.core.compensation`
    # the learners push while their next step computes (Rudra-adv*): their own last updates may be missing from the
    # weights a gradient came from, so none of them is exempt from its staleness (core/staleness.py)
    overlap: bool = False
    # what a gradient staler than max_staleness gets: dropped, or the pushes that would make it so held back (SSP)
    on_stale: str = "drop"
    # batchsync: the gradients of the current weights an update averages (None: λ); hardsync: the learners a round
    # does not wait for (:mod:`lightning_rudra.core.rounds`)
    k: Optional[int] = None
    backup: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.num_learners, bool) or not isinstance(self.num_learners, int) or self.num_learners < 1:
            raise ConfigurationError(f"num_learners={self.num_learners!r} is not valid: expected an integer >= 1.")
        validate_options(
            self.protocol,
            self.n,
            self.lr_modulation,
            self.max_staleness,
            self.nonfinite,
            self.compensation,
            self.on_stale,
        )
        validate_rounds(
            self.protocol, self.k, self.backup, self.num_learners, self.max_staleness, self.on_stale, self.overlap
        )
        validate_n(self.protocol, self.n, self.num_learners)
        validate_blocking(self.protocol, self.n, self.max_staleness, self.on_stale, self.num_learners)
        if self.on_stale == "block" and self.overlap:
            raise ConfigurationError(OVERLAP_BLOCKS)

    @property
    def discards_late(self) -> bool:
        """Whether a gradient that comes after its round closed is not applied (K-batch-sync, backup learners):
        its batch is then dealt again (:mod:`lightning_rudra.core.rounds`)."""
        return self.protocol == "batchsync" or self.backup > 0

    @property
    def gradients_per_update(self) -> int:
        """c: how many gradients one update averages (hardsync: one from every learner; batchsync: K)."""
        if self.protocol == "batchsync":
            return self.k or self.num_learners
        if self.protocol == "async":
            return 1
        if self.protocol == "softsync":
            return self.num_learners // self.n
        return self.num_learners
