"""Test-session setup: Triton kernels run under the interpreter on a machine without a GPU, and
tests marked ``gpu`` are skipped there (scripts/gpu_suite.sh runs them on the GPU machine)."""

import os

import pytest

# Must be set before triton is first imported (SGLang's fla kernels are decorated at import time).
if os.environ.get("SSM_MODES_FORCE_GPU") != "1":
    try:
        import torch

        _HAS_CUDA = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is caught by test_environment
        _HAS_CUDA = False
    if not _HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    _HAS_CUDA = True


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_suite.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
