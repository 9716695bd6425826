"""Native-mode kernels of our own where SGLang 0.5.14 has none: speculative verify for KDA
(Kimi-Linear), storing every draft node's state like SGLang's GDN verify."""

from .verify import native_verify

__all__ = ["native_verify"]
