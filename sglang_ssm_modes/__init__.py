"""sglang-ssm-modes: native / compact / replay storage modes for the recurrent state of SGLang's
hybrid linear-attention models (Gated DeltaNet and Kimi Delta Attention).

The core (``reference``, ``config``, ``sizing``) does not import SGLang; the SGLang glue depends on
the core, never the reverse.
"""

__version__ = "0.1.0"
SUPPORTED_SGLANG_VERSION = "0.5.14"
