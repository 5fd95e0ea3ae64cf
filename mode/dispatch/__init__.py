from mode.dispatch.local import LocalDispatcher

__all__ = ["LocalDispatcher"]
