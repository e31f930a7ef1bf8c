"""What a push and a pull carry: :class:`Payload`."""

from dataclasses import dataclass

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.runtime.checks import count, non_negative

# bytes per parameter on the wire: float32, or bfloat16 with error feedback (lightning_rudra.core.compression)
BYTES_PER_PARAMETER = {"none": 4, "bf16": 2}


@dataclass(frozen=True)
class Payload:
    """The model's ``parameters`` and the ``compression`` of pushes and pulls (``none``: 4 B a parameter, ``bf16``:
    2; with bf16 the weights come back as bfloat16 differences too, so both directions shrink). ``learner_codec``
    and ``server_codec``: bf16's CPU seconds per parameter of a push that crosses to another host (RPC), the
    learner's (error feedback, decoding the reply) and the server's (widening the gradient, encoding the weights'
    difference); default none (:data:`MEASURED_BF16` was measured here)."""

    parameters: int
    compression: str = "none"
    learner_codec: float = 0.0
    server_codec: float = 0.0

    def __post_init__(self) -> None:
        count("Payload parameters", self.parameters)
        non_negative("Payload learner_codec", self.learner_codec)
        non_negative("Payload server_codec", self.server_codec)
        if self.compression not in BYTES_PER_PARAMETER:
            raise ConfigurationError(
                f"compression={self.compression!r} is not supported by the runtime model: expected one of "
                f"{', '.join(map(repr, BYTES_PER_PARAMETER))}."
            )

    @property
    def push_bytes(self) -> int:
        return self.parameters * BYTES_PER_PARAMETER[self.compression]

    @property
    def pull_bytes(self) -> int:
        return self.parameters * BYTES_PER_PARAMETER[self.compression]


# bf16's CPU cost (learner, server) in seconds per parameter, measured on the 2-core AMD EPYC of this project (torch
# 2.13 CPU, one thread; medians of 7 rounds through lightning_rudra.core.compression at 1 and 10 M parameters, a
# line through them, its intercept 0), while other jobs shared the machine:
#   python -m benchmarks.predict --measure-codec
# (the coefficients and this command are in benchmarks/results/predict.json under "codec"; the points it printed:
# 1 M: learner 1.50 ms, server 1.08 ms; 10 M: 62.1 ms, 77.8 ms).
MEASURED_BF16 = (6.73e-09, 8.52e-09)
