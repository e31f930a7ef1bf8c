"""A runtime model of the parameter server: how fast and how stale each protocol is for λ learners on a cluster, as a
discrete-event simulation. Plain Python (no torch): inputs (:class:`StepTime`, :class:`Payload`, :class:`Link`,
:class:`Cluster`, :class:`ServerCost`, :class:`Protocol`, gathered in a :class:`Scenario`), the simulation
(:func:`simulate`) and what it predicts (:class:`Prediction`), whose push order drives the simulated learners through
:class:`PredictedTiming`. See ``docs/prediction.md``."""

from lightning_rudra.core.runtime.cluster import Cluster
from lightning_rudra.core.runtime.link import Link
from lightning_rudra.core.runtime.payload import MEASURED_BF16, Payload
from lightning_rudra.core.runtime.predicted_timing import PredictedTiming
from lightning_rudra.core.runtime.prediction import Prediction
from lightning_rudra.core.runtime.protocol import Protocol
from lightning_rudra.core.runtime.scenario import Scenario
from lightning_rudra.core.runtime.server_cost import MEASURED_SERVER, ServerCost
from lightning_rudra.core.runtime.simulation import Simulation, simulate
from lightning_rudra.core.runtime.step_time import StepTime

__all__ = [
    "Cluster",
    "Link",
    "MEASURED_BF16",
    "MEASURED_SERVER",
    "Payload",
    "PredictedTiming",
    "Prediction",
    "Protocol",
    "Scenario",
    "ServerCost",
    "Simulation",
    "StepTime",
    "simulate",
]
