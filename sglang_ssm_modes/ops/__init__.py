"""Triton kernels of the modes, one folder per mode, each beside its plain-torch reference."""
