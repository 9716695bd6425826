"""The CPU test environment holds the real SGLang 0.5.14 and the modules this project extends."""

import importlib

import pytest

import sglang_ssm_modes

SGLANG_MODULES = [
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.layers.attention.hybrid_linear_attn_backend",
    "sglang.srt.mem_cache.mamba_radix_cache",
    "sglang.srt.speculative.spec_utils",
    "sglang.srt.server_args",
    "sglang.srt.models.qwen3_next",
    "sglang.srt.models.kimi_linear",
    "sglang.srt.layers.attention.fla.fused_sigmoid_gating_recurrent",
    "sglang.srt.layers.attention.fla.fused_recurrent",
    "sglang.srt.layers.attention.fla.chunk",
    "sglang.srt.layers.attention.fla.kda",
    "sglang.srt.layers.attention.mamba.mamba_state_scatter_triton",
]


def test_sglang_version_is_pinned_release():
    import sglang

    assert sglang.__version__ == sglang_ssm_modes.SUPPORTED_SGLANG_VERSION == "0.5.14"


@pytest.mark.parametrize("module", SGLANG_MODULES)
def test_sglang_module_imports(module):
    assert importlib.import_module(module) is not None


def test_real_sglang_classes_are_importable():
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool
    from sglang.srt.speculative.spec_utils import commit_mamba_states_after_verify

    assert callable(commit_mamba_states_after_verify)
    for cls in (MambaPool, HybridReqToTokenPool, MambaRadixCache, MambaAttnBackendBase):
        assert cls.__module__.startswith("sglang.srt.")


def _package_modules() -> list[str]:
    import pkgutil

    return sorted(m.name for m in pkgutil.walk_packages(sglang_ssm_modes.__path__, "sglang_ssm_modes.")
                  if not m.name.endswith("__main__"))


@pytest.mark.slow
def test_every_package_module_imports_first_in_a_fresh_process():
    """No import cycle hides behind the order the tests happen to import in: each module of the
    package is imported first, alone, in a new interpreter."""
    import subprocess
    import sys

    script = ("import importlib, sys\nfailed = []\nfor name in sys.argv[1:]:\n"
              "    import subprocess\n"
              "    r = subprocess.run([sys.executable, '-c', f'import {name}'], capture_output=True, text=True)\n"
              "    if r.returncode: failed.append((name, r.stderr.strip().splitlines()[-1]))\n"
              "print(failed)\nsys.exit(1 if failed else 0)\n")
    proc = subprocess.run([sys.executable, "-c", script, *_package_modules()], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
