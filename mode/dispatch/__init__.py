from mode.dispatch.base import Dispatcher
from mode.dispatch.local import LocalDispatcher

__all__ = ["Dispatcher", "ExpertParallelDispatcher", "LocalDispatcher"]


def __getattr__(name: str):
    # Lazy: importing mode must not import torch.distributed (only the expert-parallel dispatcher does).
    if name == "ExpertParallelDispatcher":
        from mode.dispatch.expert_parallel import ExpertParallelDispatcher

        return ExpertParallelDispatcher
    raise AttributeError(f"module 'mode.dispatch' has no attribute {name!r}")
