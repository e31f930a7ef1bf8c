"""A network link: :class:`Link`."""

import math
from dataclasses import dataclass

from lightning_rudra.core.runtime.checks import non_negative, positive


@dataclass(frozen=True)
class Link:
    """A host's link, each direction its own (full duplex): ``bandwidth`` in bit/s (math.inf: no cost) and the
    one-way ``latency`` in seconds. A message of b bytes holds the sender's outgoing and the receiver's incoming
    side for 8b / bandwidth (one message at a time: the link serializes them, FIFO), then arrives ``latency``
    later. ``per_message`` and ``per_byte``: the transport's own cost of a message (RPC's serialization and copies,
    measured by an echo on one host), added to its arrival but not holding the link."""

    bandwidth: float = math.inf
    latency: float = 0.0
    per_message: float = 0.0
    per_byte: float = 0.0

    def __post_init__(self) -> None:
        positive("Link bandwidth", self.bandwidth, allow_inf=True)
        non_negative("Link latency", self.latency)
        non_negative("Link per_message", self.per_message)
        non_negative("Link per_byte", self.per_byte)

    def overhead(self, nbytes: float) -> float:
        """The transport's time for a message of ``nbytes`` beside the wire's."""
        return self.per_message + self.per_byte * nbytes

    def seconds(self, nbytes: float) -> float:
        """How long ``nbytes`` hold the link (latency apart)."""
        return 8.0 * nbytes / self.bandwidth

    @classmethod
    def gbit(cls, rate: float, latency: float = 0.0) -> "Link":
        return cls(rate * 1e9, latency)

    def with_transport(self, transport: "Link") -> "Link":
        """This wire with ``transport``'s per-message and per-byte cost."""
        return Link(self.bandwidth, self.latency, transport.per_message, transport.per_byte)
