"""``python -m sglang_ssm_modes demo``: the three modes on a tiny hybrid stack, checked against native."""

from .run import main, run_demo

__all__ = ["main", "run_demo"]
