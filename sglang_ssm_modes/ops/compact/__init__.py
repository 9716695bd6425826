"""Compact mode kernels (Triton): output-only verify that records raw inputs, and the commit of
accepted prefixes. The plain-torch reference beside them is :mod:`sglang_ssm_modes.reference.compact`."""

from .commit import compact_commit
from .records import CompactRecordBuffers
from .verify import FAST_VERIFY_TILE, compact_verify

__all__ = ["FAST_VERIFY_TILE", "CompactRecordBuffers", "compact_commit", "compact_verify"]
