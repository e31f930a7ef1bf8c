"""What a push and a pull carry: :class:`Payload`."""

from dataclasses import dataclass

from lightning_rudra.core.errors import ConfigurationError
from lightning_rudra.core.runtime.checks import count

# bytes per parameter on the wire: float32, or bfloat16 with error feedback (lightning_rudra.core.compression)
BYTES_PER_PARAMETER = {"none": 4, "bf16": 2}


@dataclass(frozen=True)
class Payload:
    """The model's ``parameters`` and the ``compression`` of pushes and pulls (``none``: 4 B a parameter, ``bf16``:
    2; with bf16 the weights come back as bfloat16 differences too, so both directions shrink)."""

    parameters: int
    compression: str = "none"

    def __post_init__(self) -> None:
        count("Payload parameters", self.parameters)
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
