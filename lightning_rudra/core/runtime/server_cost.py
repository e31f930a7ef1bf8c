"""What a server's work costs: :class:`ServerCost`, and the coefficients measured on this project's machine."""

from dataclasses import dataclass

from lightning_rudra.core.runtime.checks import non_negative


@dataclass(frozen=True)
class ServerCost:
    """A server's time, in seconds, as a line in the parameters it holds: per received push (the checks, summing
    the gradient in) ``push_per_parameter`` × N + ``push_fixed``, and per update (the optimizer's step)
    ``update_per_parameter`` × N + ``update_fixed``. Sending a reply is the link's (a copy on one host)."""

    push_per_parameter: float = 0.0
    push_fixed: float = 0.0
    update_per_parameter: float = 0.0
    update_fixed: float = 0.0

    def __post_init__(self) -> None:
        for name in ("push_per_parameter", "push_fixed", "update_per_parameter", "update_fixed"):
            non_negative(f"ServerCost {name}", getattr(self, name))

    def push(self, parameters: float) -> float:
        return self.push_per_parameter * parameters + self.push_fixed

    def update(self, parameters: float) -> float:
        return self.update_per_parameter * parameters + self.update_fixed

    def scaled(self, factor: float) -> "ServerCost":
        """Every time × ``factor`` (a faster or slower server machine)."""
        return ServerCost(*(factor * getattr(self, k) for k in self.__dataclass_fields__))


# Measured on the 2-core AMD EPYC of this project (torch 2.13 CPU, one thread, momentum SGD, float32): medians of 7
# pushes into lightning_rudra.core.protocol.Server for 0.1, 1, 4 and 10 M parameters, fitted by least squares:
#   python -m benchmarks.predict --measure-server
# (its output, the points and the fit, is in benchmarks/results/predict.json under "server").
MEASURED_SERVER = ServerCost(
    push_per_parameter=1.93e-10,
    push_fixed=6.0e-5,
    update_per_parameter=1.35e-09,
    update_fixed=0.0,
)
