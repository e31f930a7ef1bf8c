"""RudraStrategy's arguments once checked: one frozen value, read through read-only attributes of the strategy (as
Lightning's strategies keep theirs behind properties). Servers and learners are set up from them: changing one on
a built strategy would leave its processes running under the old value, so an assignment is refused."""

from dataclasses import dataclass
from typing import Any, Generic, NoReturn, Optional, TypeVar, Union, overload

from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.timing import TimingModel

T = TypeVar("T")


@dataclass(frozen=True)
class StrategyOptions:
    """What :class:`~lightning_rudra.strategy.rudra.RudraStrategy` was built with, checked, with the defaults that
    depend on other arguments filled in (``lr_modulation``, ``compensation``, ``sampling``, ``timing``). Each field
    is described in the strategy's ``Args:`` and in ``docs/options.md``."""

    protocol: str
    n: int
    lr_modulation: str
    compensation: str
    max_staleness: Optional[int]
    on_stale: str
    k: Optional[int]
    backup: int
    nonfinite: str
    sampling: str
    rpc_timeout: float
    min_learners: Optional[int]
    max_restarts: int
    start_method: str
    overlap: bool
    shared_memory: bool
    compression: Optional[str]
    bucket_cap_mb: Optional[float]
    num_servers: Optional[int]
    server_nodes: int
    node_aggregation: Optional[bool]
    simulate: Optional[int]
    timing: Optional[TimingModel]

    def protocol_config(self, num_learners: int) -> ProtocolConfig:
        """The rule's options, which learner 0 hands the servers with the model."""
        return ProtocolConfig(
            num_learners=num_learners,
            protocol=self.protocol,
            n=self.n,
            lr_modulation=self.lr_modulation,
            max_staleness=self.max_staleness,
            nonfinite=self.nonfinite,
            compensation=self.compensation,
            overlap=self.overlap,
            on_stale=self.on_stale,
            k=self.k,
            backup=self.backup,
        )

    @property
    def discards_late(self) -> bool:
        """K-batch-sync or backup learners: a late gradient is not applied, and its batch is dealt again."""
        return self.protocol == "batchsync" or self.backup > 0


class Option(Generic[T]):
    """One argument of the strategy, read from its :class:`StrategyOptions`; assigning it raises AttributeError."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, strategy: None, owner: Optional[type] = None) -> "Option[T]": ...

    @overload
    def __get__(self, strategy: "StrategyArguments", owner: Optional[type] = None) -> T: ...

    def __get__(self, strategy: Optional["StrategyArguments"], owner: Optional[type] = None) -> Union[T, "Option[T]"]:
        if strategy is None:  # read on the class
            return self
        return getattr(strategy._options, self.name)

    def __set__(self, strategy: Any, value: Any) -> NoReturn:
        raise AttributeError(
            f"RudraStrategy.{self.name} cannot be changed once the strategy is built (to {value!r}): the servers and "
            f"learners are set up from it. Build a new RudraStrategy({self.name}={value!r}, ...) instead."
        )

    def __delete__(self, strategy: Any) -> NoReturn:
        raise AttributeError(
            f"RudraStrategy.{self.name} cannot be deleted: the servers and learners are set up from it. Build a new "
            "RudraStrategy(...) instead."
        )


class StrategyArguments:
    """RudraStrategy's arguments as read-only attributes: ``strategy.protocol``, ``strategy.n``, ..."""

    _options: StrategyOptions

    protocol = Option[str]()
    n = Option[int]()
    lr_modulation = Option[str]()
    compensation = Option[str]()
    max_staleness = Option[Optional[int]]()
    on_stale = Option[str]()
    k = Option[Optional[int]]()
    backup = Option[int]()
    nonfinite = Option[str]()
    sampling = Option[str]()
    rpc_timeout = Option[float]()
    min_learners = Option[Optional[int]]()
    max_restarts = Option[int]()
    start_method = Option[str]()
    overlap = Option[bool]()
    shared_memory = Option[bool]()
    compression = Option[Optional[str]]()
    bucket_cap_mb = Option[Optional[float]]()
    num_servers = Option[Optional[int]]()
    server_nodes = Option[int]()
    node_aggregation = Option[Optional[bool]]()
    simulate = Option[Optional[int]]()
    timing = Option[Optional[TimingModel]]()
