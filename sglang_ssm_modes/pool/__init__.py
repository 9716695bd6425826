"""Mode-pluggable state pool on SGLang 0.5.14's ``MambaPool`` (SGLang glue: imports SGLang)."""

from .mode_pool import LinearHeads, ModeHybridReqToTokenPool, ModeMambaPool

__all__ = ["LinearHeads", "ModeHybridReqToTokenPool", "ModeMambaPool"]
