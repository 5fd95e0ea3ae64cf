"""The benchmarks of ``mode``, by concern (docs/benchmarks.md, "Layout"): each script runs by path from the
repository root, ``PYTHONPATH=. python benchmarks/<folder>/<script>.py``, and shares ``benchmarks.common``."""
