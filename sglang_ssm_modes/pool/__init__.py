"""Mode-pluggable state pool on SGLang 0.5.14's ``MambaPool`` (SGLang glue: imports SGLang)."""

from .mode_pool import ConvScratchState, LinearHeads, ModeMambaPool, init_mode_mamba_pool

__all__ = ["ConvScratchState", "LinearHeads", "ModeMambaPool", "init_mode_mamba_pool"]
