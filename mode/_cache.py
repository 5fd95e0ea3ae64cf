"""The one folder where mode keeps what it builds or fetches once (SmolLM2's GGUF, the packages corpus, parsed
docstrings, text a model sampled, transformers' test files): ``cache_root``."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MODE_CACHE"
OLD_CACHE_ENV = "MODE_CACHE_DIR"  # the name the packages corpus read first; the same folder now


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` if given, else ``$MODE_CACHE``, else ``$MODE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mode``,
    else ``~/.cache/mode`` (an environment variable set to the empty string counts as unset)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    for name in (CACHE_ENV, OLD_CACHE_ENV):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "mode"
    return Path.home() / ".cache" / "mode"
