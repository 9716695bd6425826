"""Every shipped script runs here as far as a CPU allows: argument checks, the report writer on
synthetic rows, the GPU suite's part selection."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_compact  # noqa: E402


def _run(*args, **kw):
    return subprocess.run(list(args), capture_output=True, text=True, cwd=ROOT, timeout=300, **kw)


def test_bench_compact_refuses_to_run_without_a_gpu():
    proc = _run(sys.executable, "scripts/bench_compact.py", "--out", "/tmp/unused")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


@pytest.mark.parametrize("bad", [["--verify-tiles", "12x1"], ["--verify-tiles", "16"], ["--batches", "0"]])
def test_bench_compact_validates_arguments(bad, monkeypatch):
    monkeypatch.setattr(bench_compact.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exc:
        bench_compact.main(["--out", "/tmp/unused", *bad])
    assert exc.value.code == 2


def test_bench_compact_report_from_rows(tmp_path):
    rows = []
    for op, us in (("spec_round", (100.0, 50.0)), ("verify", (70.0, 30.0)), ("commit", (30.0, 20.0))):
        for impl, t in zip(("sglang-0.5.14-native", "ours-compact"), us):
            rows.append(dict(op=op, family="gdn", impl=impl, state_dtype="float32", batch=64, draft_tokens=4,
                             median_us=t, bytes_min=1, frac_copy_bw=0.5, bytes_per_request=100 if t > 60 else 20,
                             path="p", mean_accepted=2.5))
    result = dict(gpu="GPU", date="2026-12-02", commit="abc", copy_bw_gbps=4000.0, state_dtypes=["float32"],
                  draft_tokens=[4], rows=rows)
    bench_compact.write_report(result, str(tmp_path))
    assert json.loads((tmp_path / "compact_h200.json").read_text())["rows"] == rows
    table = (tmp_path / "compact_h200.md").read_text()
    assert "| gdn | float32 | 4 | 64 | 100.0 | 50.0 | 2.00× | 70.0 + 30.0 | 30.0 + 20.0 |" in table


def test_committed_compact_results_have_the_agreed_fields():
    data = json.loads((ROOT / "bench/results/compact_h200.json").read_text())
    assert {"gpu", "date", "commit", "copy_bw_gbps", "rows"} <= data.keys() and "H200" in data["gpu"]
    fields = {"op", "family", "impl", "state_dtype", "batch", "draft_tokens", "median_us", "bytes_min",
              "frac_copy_bw", "bytes_per_request", "path"}
    for row in data["rows"]:
        assert fields <= row.keys()
        assert row["op"] in {"decode", "verify", "commit", "spec_round", "fold", "materialise"}
        assert row["impl"] in {"sglang-0.5.14-native", "ours-native", "ours-compact", "ours-replay",
                               "upstream-replayssm", "fla"}


def test_gpu_suite_names_its_parts_and_needs_the_site_archive(tmp_path):
    proc = _run("bash", "scripts/gpu_suite.sh", "nonsense", env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert proc.returncode == 2
    assert "unknown part 'nonsense'" in proc.stderr
