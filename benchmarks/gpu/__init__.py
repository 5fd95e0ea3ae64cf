"""The GPU suite (gpu_suite.py, one file per stage group), its Markdown report and the pytest failure plugin."""
