"""Test-session setup: Triton kernels run under the interpreter on a machine without a GPU, and
tests marked ``gpu`` are skipped there (scripts/gpu_suite.sh runs them on the GPU machine); ``--gpu-shard I/N``
keeps every N-th selected test from the I-th (scripts/gpu_suite.sh tests:shard=I/N: the suite in several calls;
a shard with no test in it exits 5, as pytest does with nothing selected)."""

import argparse
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


def pytest_addoption(parser):
    parser.addoption("--gpu-shard", metavar="I/N", default=None, type=_shard,
                     help="run the I-th of N shares of the selected tests (every N-th from the I-th in collection "
                          "order), so that the GPU suite's tests fit calls of limited time "
                          "(scripts/gpu_suite.sh tests:shard=I/N)")


def _shard(value: str) -> tuple[int, int]:
    """``I/N`` as ``(I, N)``, 1 <= I <= N; a bad value is refused as the arguments are parsed, naming the form."""
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"{value!r}: expected I/N with 1 <= I <= N, e.g. 2/3")
    return i, n


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu-shard") is not None:
        i, n = config.getoption("--gpu-shard")
        keep, drop = [], []
        for k, item in enumerate(items):
            (keep if k % n == i - 1 else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_suite.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
