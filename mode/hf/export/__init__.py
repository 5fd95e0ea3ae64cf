"""mode models out to transformers: ``export_transformers`` (a checkpoint or LM as a folder that
``AutoModelForCausalLM`` and ``AutoTokenizer`` load), the standard families it picks by exact math
(``LAYOUTS``), and mode's own transformers class (``ModeConfig``, ``ModeForCausalLM``) for the rest."""

from mode.hf.export.export import ExportResult, choose_layout, export_transformers
from mode.hf.export.layouts import LAYOUTS, Layout
from mode.hf.export.modeling import ModeCache, ModeConfig, ModeForCausalLM

__all__ = [
    "LAYOUTS",
    "ExportResult",
    "Layout",
    "ModeCache",
    "ModeConfig",
    "ModeForCausalLM",
    "choose_layout",
    "export_transformers",
]
