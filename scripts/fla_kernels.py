"""flash-linear-attention's fused recurrent kernels (``fla-core`` 0.6.0), for the replay benchmark's ``fla``
decode rows: another native-style decode (reads the state, writes the next one) beside SGLang's.

The GPU machine has no package index, so ``extract`` takes the pure-Python ``fla`` package and the
``einops`` it imports out of their wheels into a git-ignored folder the GPU suite carries (``.gpu/``);
:func:`load` puts that folder on ``sys.path``. Nothing of fla is copied into this repository.

    python scripts/fla_kernels.py extract [--wheels DIR] [--out .gpu/fla-core-0.6.0]

Without ``--wheels`` (a folder holding both wheels) they are fetched with ``pip download --no-deps``.
fla keeps no state indices: :func:`decode` runs on a contiguous ``[N, HV, V, K]`` block of states
(``state_v_first``: SGLang's pool layout) and returns the next states as a new tensor.
"""

from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from wheel_cli import extract_main

WHEELS = {"fla_core": ("fla-core==0.6.0", "fla/"), "einops": ("einops==0.8.2", "einops/")}
"""Distribution file prefix -> (pip requirement, package folder inside the wheel)."""
DEFAULT_DIR = Path(".gpu") / "fla-core-0.6.0"


def extract(wheels: Path | None, out: Path) -> Path:
    """Unpack the ``fla`` and ``einops`` packages from their wheels (in ``wheels``, or fetched with pip
    when None) into ``out``, with ``SOURCE`` naming each wheel and its sha256. Returns ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        if wheels is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                            *(req for req, _ in WHEELS.values())], check=True)
            wheels = Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        source = []
        for prefix, (req, package) in WHEELS.items():
            found = sorted(Path(wheels).glob(f"{prefix}-*.whl"))
            if not found:
                raise FileNotFoundError(f"no {prefix}-*.whl in {wheels} ({req})")
            with zipfile.ZipFile(found[-1]) as z:
                z.extractall(out, [n for n in z.namelist() if n.startswith(package)])
            source.append(f"{found[-1].name} sha256 {hashlib.sha256(found[-1].read_bytes()).hexdigest()}")
        (out / "SOURCE").write_text("\n".join(source) + "\n")
    return out


def load(folder: Path):
    """``(fused_recurrent_gated_delta_rule, fused_recurrent_kda)`` imported from ``folder``."""
    if not (Path(folder) / "fla" / "__init__.py").is_file():
        raise FileNotFoundError(f"fla is not extracted at {folder}: run `python scripts/fla_kernels.py extract "
                                f"--out {folder}`")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    gdn = importlib.import_module("fla.ops.gated_delta_rule")
    kda = importlib.import_module("fla.ops.kda")
    return gdn.fused_recurrent_gated_delta_rule, kda.fused_recurrent_kda


def decode(kernels, A_log, a, dt_bias, q, k, v, b, states, *, is_kda: bool):
    """One decode token of N requests through fla's fused recurrent kernel, gates and beta sigmoid in
    the kernel, q/k L2-normalised in it (as SGLang's decode): ``q, k`` ``[N, 1, H, K]``, ``v`` ``[N, 1, HV,
    V]``, ``a`` ``[N, HV]`` (GDN) or ``[N, HV * K]`` (KDA), ``b`` ``[N, HV]`` logits, ``states`` ``[N, HV, V,
    K]`` contiguous. Returns ``(o [N, 1, HV, V], next states [N, HV, V, K])``."""
    gdn, kda = kernels
    n, hv = v.shape[0], v.shape[2]
    common = dict(beta=b.reshape(n, 1, hv), A_log=A_log, dt_bias=dt_bias, initial_state=states,
                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, state_v_first=True)
    if is_kda:
        return kda(q, k, v, g=a.reshape(n, 1, hv, -1), **common)
    return gdn(q, k, v, g=a.reshape(n, 1, hv), **common)


def main(argv=None) -> int:
    return extract_main(argv, __doc__.split("\n\n")[0], "unpack fla and einops from their wheels into --out",
                        "--wheels", "a folder with the fla_core-0.6.0 and einops wheels (default: pip download)",
                        True, DEFAULT_DIR, extract)


if __name__ == "__main__":
    sys.exit(main())
