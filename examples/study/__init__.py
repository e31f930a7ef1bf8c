"""The studies on MNIST-1D, one module a part.

- ``python -m examples.study``: the Rudra paper's accuracy/runtime tradeoff study (``__main__.py``), split into
  ``grid.py`` (configurations and grids), ``runner.py`` (one configuration, in its own subprocess), ``runs.py``
  (running them, ``runs.csv``), ``report.py`` (``results.md``, plots) and ``findings.py`` (the paper-scale
  grid's ``findings.md``);
- ``python -m examples.study.compensation``: which staleness compensation rule to use, with simulated learners
  (``compensation.py``: the runs and the choices on validation; ``compensation_report.py``: ``findings.md``).
"""
