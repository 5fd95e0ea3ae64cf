from mode.experts.bank import ExpertBank, ExpertConfig

__all__ = ["ExpertBank", "ExpertConfig"]
