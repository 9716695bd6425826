"""scripts/upstream_replayssm.py: taking upstream SGLang's ReplaySSM decode kernel out of the 0.5.23
wheel and calling it from the replay benchmark. The extraction and loading run everywhere (on a wheel
built here); the numerics — upstream's decode against the float64 reference over several flushes —
wherever the extracted kernel lies (``.gpu/upstream-sglang-0.5.23``, or ``$UPSTREAM_REPLAYSSM_DIR``:
``make test`` extracts it, the GPU suite carries it in ``.gpu/``)."""

import os
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kernel_cases import DEVICE
from sglang_ssm_modes.reference import decode
from sglang_ssm_modes.reference.random_layer import random_gate_params, random_inputs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import upstream_replayssm  # noqa: E402

UPSTREAM = Path(os.environ.get("UPSTREAM_REPLAYSSM_DIR", ROOT / upstream_replayssm.DEFAULT_DIR))


def test_extract_and_load_from_a_wheel(tmp_path):
    wheel = tmp_path / "sglang-0.5.23-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(upstream_replayssm.WHEEL_PATH, "ANSWER = 42\n")
        z.writestr("sglang/__init__.py", "")
    with pytest.raises(FileNotFoundError, match="extract --out"):
        upstream_replayssm.load(tmp_path / "kernels")
    path = upstream_replayssm.extract(wheel, tmp_path / "kernels")
    assert path.read_text() == "ANSWER = 42\n"
    assert (tmp_path / "kernels" / "SOURCE").read_text().startswith(f"{wheel.name} {upstream_replayssm.WHEEL_PATH}")
    assert upstream_replayssm.load(tmp_path / "kernels").ANSWER == 42
    assert "sglang" not in upstream_replayssm.load(tmp_path / "kernels").__name__  # its own name, not SGLang's


def test_extract_refuses_a_missing_wheel(tmp_path, capsys):
    with pytest.raises(SystemExit):
        upstream_replayssm.main(["extract", "--wheel", str(tmp_path / "none.whl"), "--out", str(tmp_path)])
    assert "no such file" in capsys.readouterr().err


@pytest.mark.skipif(not (UPSTREAM / upstream_replayssm.MODULE).is_file(),
                    reason=f"the upstream kernel is not extracted at {UPSTREAM}")
@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_upstream_decode_tracks_the_float64_reference(family, hk, hv):
    """Upstream's decode, driven as the benchmark drives it (q, k, v handed side by side on odd steps, cursor
    advanced after each step, a flush every L steps, a padding row), against the native recurrence in float64,
    outputs every step. Its
    reconstruction ``tl.dot`` runs in the output dtype: bfloat16 on the GPU, as served (a bfloat16-sized
    bound); float32 under the CPU interpreter, whose bfloat16 ``tl.dot`` returns garbage. This checks that
    the benchmark calls it right, not that it is exact."""
    is_kda = family == "kda"
    n, kdim, vdim, L, steps = 3, 32, 32, 4, 9
    gen = torch.Generator().manual_seed(70)
    params = random_gate_params(family, hv, kdim, gen)
    x = random_inputs(family, n, steps, hk, hv, kdim, vdim, gen, torch.bfloat16)
    state = 0.1 * torch.randn(n + 2, hv, vdim, kdim, generator=gen)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    module = upstream_replayssm.load(UPSTREAM)
    pool = state.clone().to(DEVICE)
    ring = upstream_replayssm.UpstreamRing.allocate(n + 2, L, hk, hv, kdim, vdim, is_kda, DEVICE)
    write_pos = torch.zeros(n, dtype=torch.int32, device=DEVICE)
    real = slots >= 0
    ref_o, _ = decode(state[slots.clamp_min(0).long()].double(), x, params, torch.float64)
    out_dtype, tol = (torch.bfloat16, 0.05) if DEVICE == "cuda" else (torch.float32, 5e-3)
    out = torch.empty(n, 1, hv, vdim, dtype=out_dtype, device=DEVICE)
    for t in range(steps):
        step = x.tokens(t, t + 1)  # one token of every request
        a = step.a.reshape(n, -1).to(DEVICE)
        q, k, v = (t_.transpose(0, 1).to(DEVICE) for t_ in (step.q, step.k, step.v))
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], -1) if t % 2 else None  # as served
        o = upstream_replayssm.decode(module, params.A_log.to(DEVICE), a, params.dt_bias.to(DEVICE), q, k, v,
                                      step.b.reshape(1, n, hv).to(DEVICE), pool, slots.to(DEVICE), ring, write_pos,
                                      is_kda=is_kda, out=out, mixed=mixed)
        upstream_replayssm.advance(write_pos, L)
        torch.testing.assert_close(o[real, 0].double().cpu(), ref_o[real, t], rtol=tol, atol=tol)
        assert (o[~real.to(o.device)] == 0).all()
    assert torch.equal(write_pos.cpu(), torch.full((n,), steps % L, dtype=torch.int32))
