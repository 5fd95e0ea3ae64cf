from mode.experts.bank import BACKENDS, ExpertBank, ExpertConfig, resolve_backend

__all__ = ["BACKENDS", "ExpertBank", "ExpertConfig", "resolve_backend"]
