"""The acceptance step every speculative path commits through (SGLang glue)."""

from .state_acceptance import StateAcceptance

__all__ = ["StateAcceptance"]
