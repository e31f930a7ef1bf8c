"""Where the learners and the servers are, and what joins them: :class:`Cluster`."""

import math
from dataclasses import dataclass, field

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.runtime.checks import count, positive
from lightning_rudra.core.runtime.link import Link

PLACEMENTS = ("learner_hosts", "own_hosts")


@dataclass(frozen=True)
class Cluster:
    """``hosts`` × ``learners_per_host`` learners (learner r on host r // learners_per_host), ``num_servers``
    servers, each holding an even share of the parameters and serving its pushes one at a time (FIFO).

    ``link``: every host's link to the others. ``local``: the path between a learner and a server on its own host
    (shared memory: no queue, each copy in parallel; default free). ``servers_on``: ``learner_hosts`` (server i on
    host i % hosts, as this plugin starts them) or ``own_hosts`` (each server on a host of its own with a ``link``
    of its own, as a dedicated parameter-server tier). ``node_aggregation``: under hardsync (no backup), the
    learners of a host sum their gradients and one push per host goes out, one reply comes back.

    ``cores``: each host's CPU cores (math.inf: none shared). With n busy processes on a host (learners computing or
    busy-waiting, a server working) each runs at min(1, cores / n) of a core (processor sharing). ``one_machine``:
    every host is a namespace of one machine, so all share its ``cores``. ``shared_memory``: a learner reads the
    weights of a server on its own host from shared memory when its reply lands (the newest, of the clock then,
    as ``lightning_rudra.transport.shm`` reads them); otherwise (RPC, another host) a reply carries the weights of the
    moment it was sent."""

    hosts: int = 1
    learners_per_host: int = 1
    link: Link = field(default_factory=Link)
    local: Link = field(default_factory=Link)
    num_servers: int = 1
    servers_on: str = "learner_hosts"
    node_aggregation: bool = True
    cores: float = math.inf
    one_machine: bool = False
    shared_memory: bool = False

    def __post_init__(self) -> None:
        count("hosts", self.hosts)
        count("learners_per_host", self.learners_per_host)
        count("num_servers", self.num_servers)
        positive("cores", self.cores, allow_inf=True)
        if self.servers_on not in PLACEMENTS:
            raise ConfigurationError(
                f"servers_on={self.servers_on!r} is not supported: expected one of {', '.join(map(repr, PLACEMENTS))}."
            )
        for name in ("link", "local"):
            if not isinstance(getattr(self, name), Link):
                raise ConfigurationError(f"{name}={getattr(self, name)!r} is not valid: expected a Link.")

    @property
    def learners(self) -> int:
        """λ."""
        return self.hosts * self.learners_per_host

    def host_of_learner(self, learner: int) -> int:
        return learner // self.learners_per_host

    def host_of_server(self, server: int) -> int:
        """Hosts 0 .. hosts-1 hold learners; with ``own_hosts`` server i is host hosts + i."""
        return server % self.hosts if self.servers_on == "learner_hosts" else self.hosts + server

    def machine_of_host(self, host: int) -> int:
        """Which CPU pool ``host`` draws on."""
        return 0 if self.one_machine else host

    @property
    def all_hosts(self) -> int:
        return self.hosts + (self.num_servers if self.servers_on == "own_hosts" else 0)
