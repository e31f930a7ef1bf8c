"""Which protocol the server runs, in the runtime model's terms: :class:`Protocol`."""

from dataclasses import dataclass
from typing import Optional

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.runtime.checks import count

NAMES = ("hardsync", "batchsync", "softsync", "async")


@dataclass(frozen=True)
class Protocol:
    """``name``: ``hardsync`` (a round takes one gradient from every learner; with ``backup=b`` it closes after the
    first λ − b and the late gradients are wasted), ``batchsync`` (an update after the first ``k`` gradients
    computed on the current weights, from any learners; default k = λ; older ones wasted), ``softsync`` (c = ⌊λ/n⌋
    gradients an update) or ``async`` (c = 1). ``max_staleness`` with softsync or async: SSP, the push that would let
    another outstanding gradient exceed it is held (``on_stale="block"``, :mod:`lightning_rudra.core.ssp`)."""

    name: str = "async"
    n: int = 1
    k: Optional[int] = None
    backup: int = 0
    max_staleness: Optional[int] = None

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ConfigurationError(f"protocol={self.name!r} is not supported: expected one of {', '.join(NAMES)}.")
        count("n", self.n)
        count("backup", self.backup, least=0)
        if self.k is not None:
            count("k", self.k)
        if self.max_staleness is not None:
            count("max_staleness", self.max_staleness, least=0)
        if self.backup and self.name != "hardsync":
            raise ConfigurationError(
                f"backup={self.backup} is for protocol='hardsync', not {self.name!r}: expected backup=0."
            )
        if self.n > 1 and self.name != "softsync":  # as the strategy: n alone must not mean another protocol
            raise ConfigurationError(f"n={self.n} is for protocol='softsync', not {self.name!r}: expected n=1.")
        if self.k is not None and self.name != "batchsync":
            raise ConfigurationError(f"k={self.k} is for protocol='batchsync', not {self.name!r}: expected k=None.")
        if self.max_staleness is not None and self.name not in ("softsync", "async"):
            raise ConfigurationError(
                f"max_staleness={self.max_staleness} (SSP, blocking) is for protocol 'softsync' or 'async', "
                f"not {self.name!r}: its gradients all have σ = 0."
            )

    def check(self, learners: int) -> None:
        """The parts that depend on λ."""
        if self.name == "softsync" and self.n > learners:
            raise ConfigurationError(f"n={self.n} is larger than λ={learners}: n-softsync needs 1 <= n <= λ.")
        if self.backup >= learners:
            raise ConfigurationError(
                f"backup={self.backup} leaves no learner to wait for with λ={learners}: expected 0 <= backup < λ."
            )
        if self.k is not None and self.k > learners * 64:
            raise ConfigurationError(f"k={self.k} is not valid for λ={learners}: expected 1 <= k <= 64λ.")
        if self.max_staleness is not None:
            c = self.gradients_per_update(learners)
            least = (learners + c - 2) // c  # lightning_rudra.core.config.min_blocking_staleness
            if self.max_staleness < least:
                raise ConfigurationError(
                    f"max_staleness={self.max_staleness} cannot be kept by blocking with λ={learners} "
                    f"(c={c}): expected max_staleness >= {least}."
                )

    def gradients_per_update(self, learners: int) -> int:
        """c: gradients an update applies."""
        if self.name == "async":
            return 1
        if self.name == "softsync":
            return max(1, learners // self.n)
        if self.name == "batchsync":
            return self.k or learners
        return learners - self.backup

    def __str__(self) -> str:
        if self.name == "softsync":
            return f"{self.n}-softsync" + (f", SSP s={self.max_staleness}" if self.max_staleness is not None else "")
        if self.name == "batchsync":
            return f"batchsync k={self.k}" if self.k else "batchsync"
        if self.name == "hardsync" and self.backup:
            return f"hardsync backup={self.backup}"
        return self.name + (f", SSP s={self.max_staleness}" if self.max_staleness is not None else "")
