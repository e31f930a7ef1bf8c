"""Lightning's fit loop, refitted for one ``fit``: every change RudraStrategy makes to pytorch_lightning's loops,
their private attributes included, is made in this package (and undone at the end of training), so that a Lightning
release that moves them breaks this package only: :class:`~.shared_epoch_loop.SharedEpochLoop` for real learners drawing from
the shared epoch (``shared.py``), :class:`~.simulated.SimulatedEpochLoop` for λ simulated learners in one process
(``simulated.py``)."""
