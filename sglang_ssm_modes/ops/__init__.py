"""Triton kernels, each beside its plain-torch reference in :mod:`sglang_ssm_modes.reference`:
shared building blocks (``delta_rule_step``, ``verify_window``), then one folder per mode
(``compact``, ``replay``, ``native``) and the conv window (``conv_window``). No SGLang import."""
