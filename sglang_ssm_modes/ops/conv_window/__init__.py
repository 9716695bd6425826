"""The conv window with rollback by index move (``compact`` and ``replay``): a ring of
``K - 1 + D`` columns and an offset per slot; verify writes the window's inputs into free columns,
commit moves the offset. Triton kernels in :mod:`.kernels`; the plain-torch reference (and SGLang's
native update) is :mod:`sglang_ssm_modes.reference.conv`."""

from .kernels import conv_ring_commit, conv_ring_load, conv_ring_materialise, conv_ring_verify, ring_width

__all__ = ["conv_ring_commit", "conv_ring_load", "conv_ring_materialise", "conv_ring_verify", "ring_width"]
