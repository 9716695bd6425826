"""scripts/fla_kernels.py: fla-core 0.6.0's fused recurrent kernels for the replay benchmark's ``fla``
rows. Extraction and loading run everywhere (on wheels built here); the numerics — fla's decode, called
as the benchmark calls it, against the float64 reference over several tokens — wherever fla lies
(``.gpu/fla-core-0.6.0``, or ``$FLA_KERNELS_DIR``: ``make test`` extracts it, the GPU suite carries it)."""

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
import fla_kernels  # noqa: E402

FLA = Path(os.environ.get("FLA_KERNELS_DIR", ROOT / fla_kernels.DEFAULT_DIR))


def test_extract_takes_both_packages_out_of_their_wheels(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, package in (("fla_core-0.6.0", "fla"), ("einops-0.8.2", "einops")):
        with zipfile.ZipFile(wheels / f"{name}-py3-none-any.whl", "w") as z:
            z.writestr(f"{package}/__init__.py", f"NAME = {package!r}\n")
            z.writestr(f"{name}.dist-info/METADATA", "")
    with pytest.raises(FileNotFoundError, match="fla_kernels.py extract"):
        fla_kernels.load(tmp_path / "out")
    out = fla_kernels.extract(wheels, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["SOURCE", "einops", "fla"]  # no dist-info, nothing else
    assert (out / "fla" / "__init__.py").read_text() == "NAME = 'fla'\n"
    assert [line.split()[0] for line in (out / "SOURCE").read_text().splitlines()] == [
        "fla_core-0.6.0-py3-none-any.whl", "einops-0.8.2-py3-none-any.whl"]


def test_extract_names_a_missing_wheel(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="fla-core==0.6.0"):
        fla_kernels.extract(tmp_path, tmp_path / "out")
    with pytest.raises(SystemExit):
        fla_kernels.main(["extract", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.skipif(not (FLA / "fla" / "__init__.py").is_file(), reason=f"fla is not extracted at {FLA}")
@pytest.mark.parametrize("family,hk,hv", [("gdn", 2, 4), ("kda", 2, 2)])
def test_fla_decode_tracks_the_float64_reference(family, hk, hv):
    """fla's decode with gates, beta sigmoid and q/k norm in the kernel, V-first states (the pool's
    layout), driven token by token from its own returned states: outputs and final states against the
    native recurrence in float64 (float32 states; bfloat16 inputs)."""
    is_kda = family == "kda"
    n, kdim, vdim, steps = 3, 32, 32, 5
    gen = torch.Generator().manual_seed(80)
    params = random_gate_params(family, hv, kdim, gen)
    x = random_inputs(family, n, steps, hk, hv, kdim, vdim, gen, torch.bfloat16)
    state = 0.1 * torch.randn(n, hv, vdim, kdim, generator=gen)
    kernels = fla_kernels.load(FLA)
    ref_o, ref_state = decode(state.double(), x, params, torch.float64)
    states = state.clone().to(DEVICE)
    for t in range(steps):
        step = x.tokens(t, t + 1)
        o, states = fla_kernels.decode(kernels, params.A_log.to(DEVICE), step.a.reshape(n, -1).to(DEVICE),
                                       params.dt_bias.to(DEVICE), step.q.to(DEVICE), step.k.to(DEVICE),
                                       step.v.to(DEVICE), step.b.reshape(n, hv).to(DEVICE), states, is_kda=is_kda)
        torch.testing.assert_close(o[:, 0].double().cpu(), ref_o[:, t], rtol=2e-2, atol=2e-2)  # bf16 outputs
    assert states.shape == (n, hv, vdim, kdim) and states.dtype == torch.float32
    torch.testing.assert_close(states.double().cpu(), ref_state, rtol=1e-4, atol=1e-5)
