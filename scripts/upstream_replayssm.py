"""Upstream SGLang's ReplaySSM decode kernel, for the replay benchmark's ``upstream-replayssm`` rows.

Newer SGLang releases ship it (``sglang/kernels/ops/attention/linear/fused_recurrent_linear_replayssm.py``
in the ``sglang==0.5.23`` wheel; it imports only torch and triton). It is never copied into this
repository: ``extract`` takes that one file out of the wheel into a git-ignored folder that the GPU
suite carries (``.gpu/``), and :func:`load` imports it from there under its own module name, beside the
installed SGLang 0.5.14.

    python scripts/upstream_replayssm.py extract [--wheel WHEEL] [--out .gpu/upstream-sglang-0.5.23]

Without ``--wheel`` the wheel is fetched with ``pip download sglang==0.5.23 --no-deps``. The upstream
spec-decode kernels (``gdn_replayssm_spec_decode.py`` ...) import other ``sglang.kernels`` modules and
are not loaded yet.

Its decode keeps, per pool slot, a ring of L - 1 records (the update ``d`` and the normalised key, both
float32 here, and the float32 gate) and a cursor ``write_pos`` per batch row; the step at
``write_pos == L - 1`` folds ring and token into the checkpoint (tensor-core reconstruction, not the
native recurrence), and the caller advances ``write_pos = (write_pos + 1) % L`` (:func:`advance`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from wheel_cli import extract_main

VERSION = "0.5.23"
MODULE = "fused_recurrent_linear_replayssm.py"
WHEEL_PATH = f"sglang/kernels/ops/attention/linear/{MODULE}"
DEFAULT_DIR = Path(".gpu") / f"upstream-sglang-{VERSION}"


def extract(wheel: Path | None, out: Path) -> Path:
    """Copy the decode kernel's module out of the wheel into ``out`` (with ``SOURCE``: wheel name and
    the module's sha256); fetches the wheel with pip when ``wheel`` is None. Returns the module path."""
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={VERSION}", "--no-deps", "-d", tmp,
                            "--quiet"], check=True)
            wheel = next(Path(tmp).glob("sglang-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            source = z.read(WHEEL_PATH)
        out.mkdir(parents=True, exist_ok=True)
        (out / MODULE).write_bytes(source)
        (out / "SOURCE").write_text(f"{wheel.name} {WHEEL_PATH} sha256 {hashlib.sha256(source).hexdigest()}\n")
    return out / MODULE


def load(folder: Path):
    """The upstream module, imported from ``folder`` as ``upstream_replayssm_<version>``."""
    path = Path(folder) / MODULE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python scripts/upstream_replayssm.py extract --out {folder}`")
    name = "upstream_replayssm_" + VERSION.replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton reads the kernels' source through the module
    spec.loader.exec_module(module)
    return module


@dataclass
class UpstreamRing:
    """The caller-owned ring of upstream's decode for ``slots`` pool slots, history ``L``: ``d``
    ``[slots, HV, L, V]``, ``k`` ``[slots, H, L, K]`` (float32), ``g`` ``[slots, HV, L(, K)]`` float32."""

    d: "torch.Tensor"
    k: "torch.Tensor"
    g: "torch.Tensor"

    @staticmethod
    def allocate(slots: int, history: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 is_kda: bool, device) -> "UpstreamRing":
        import torch

        f32 = dict(dtype=torch.float32, device=device)
        g_shape = (slots, num_v_heads, history) + ((head_k_dim,) if is_kda else ())
        return UpstreamRing(d=torch.zeros(slots, num_v_heads, history, head_v_dim, **f32),
                            k=torch.zeros(slots, num_k_heads, history, head_k_dim, **f32),
                            g=torch.zeros(g_shape, **f32))


def decode(module, A_log, a, dt_bias, q, k, v, b, state, state_indices, ring: UpstreamRing, write_pos, *,
           is_kda: bool, out=None, mixed=None):
    """One upstream decode step of ``N`` requests from our benchmark's inputs (``q, k`` ``[1, N, H, K]``,
    ``v`` ``[1, N, HV, V]``, ``a`` ``[N, HV(*K)]``, ``b`` ``[1, N, HV]``; ``dt_bias`` ``[HV(*K)]``), the
    state pool ``[slots, HV, V, K]`` as checkpoints. ``mixed``: q, k and v side by side ``[N, 2 H K + HV V]``,
    as a server's conv output hands them (the benchmark builds it once, as for SGLang's decode; without it they
    are concatenated here, a copy each step). Returns ``o`` ``[N, 1, HV, V]``. The cursor is not advanced
    (:func:`advance`)."""
    import torch

    n, hk, kdim = q.shape[1], q.shape[2], q.shape[3]
    hv, vdim = v.shape[2], v.shape[3]
    if mixed is None:
        mixed = torch.cat([q.reshape(n, hk * kdim), k.reshape(n, hk * kdim), v.reshape(n, hv * vdim)], dim=-1)
    gate = a.reshape(n, hv, kdim).contiguous() if is_kda else a.reshape(n, hv)
    bias = dt_bias.reshape(hv, kdim).contiguous() if is_kda else dt_bias.reshape(hv)
    if out is None:
        out = torch.empty(n, 1, hv, vdim, dtype=v.dtype, device=v.device)
    module.fused_recurrent_linear_replayssm_decode(
        mixed, gate, b.reshape(n, hv), A_log, bias, kdim ** -0.5, state, ring.d, ring.k, ring.g, out, state_indices,
        write_pos, use_qk_l2norm_in_kernel=True, is_kda=is_kda)
    return out


def advance(write_pos, history: int) -> None:
    """The caller's cursor step after a decode: ``write_pos = (write_pos + 1) % L`` (in place, on the device)."""
    write_pos.add_(1).remainder_(history)


def main(argv=None) -> int:
    return extract_main(argv, __doc__.split("\n\n")[0],
                        "take the upstream decode kernel out of the sglang 0.5.23 wheel", "--wheel",
                        "a downloaded sglang-0.5.23 wheel (default: pip download it)", False, DEFAULT_DIR, extract)


if __name__ == "__main__":
    sys.exit(main())
