"""Every shipped script runs here as far as a CPU allows: argument checks, the report writer on
synthetic rows, the GPU suite's part selection."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_compact  # noqa: E402
import kernel_registers  # noqa: E402


def _run(*args, **kw):
    return subprocess.run(list(args), capture_output=True, text=True, cwd=ROOT, timeout=300, **kw)


def test_bench_compact_refuses_to_run_without_a_gpu():
    proc = _run(sys.executable, "scripts/bench_compact.py", "--out", "/tmp/unused")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


@pytest.mark.parametrize("bad", [["--verify-tiles", "12x1"], ["--verify-tiles", "16"], ["--verify-tiles", "16x16"],
                                 ["--verify-tiles", "16x1:prefetched"], ["--verify-tiles", "natives"],
                                 ["--batches", "0"]])
def test_bench_compact_validates_arguments(bad, monkeypatch):
    monkeypatch.setattr(bench_compact.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exc:
        bench_compact.main(["--out", "/tmp/unused", *bad])
    assert exc.value.code == 2


def test_bench_compact_tile_items():
    assert bench_compact.parse_tile("16x1") == ((16, 1), None)  # as served
    assert bench_compact.parse_tile("native:prefetch") == (None, True)
    assert bench_compact.parse_tile("16x1:noprefetch") == ((16, 1), False)
    assert bench_compact.verify_path(None, True) == "verify_window(records,native-tile,prefetch)"
    assert bench_compact.verify_path((16, 1)) == "verify_window(records,BV16xW1)"


def test_bench_compact_report_from_rows(tmp_path):
    """One case: native's round and parts, compact's round per served verify (exact, fast) with their verify and the
    shared commit, and one extra tile's verify — each figure lands in its column."""
    def row(op, impl, variant, us, path="p"):
        return dict(op=op, family="gdn", impl=impl, variant=variant, state_dtype="float32", batch=64, draft_tokens=4,
                    median_us=us, bytes_min=1, frac_copy_bw=0.5,
                    bytes_per_request=100 if impl != "ours-compact" else 20, path=path, mean_accepted=2.5)
    native = "sglang-0.5.14-native"
    rows = [row("spec_round", native, None, 100.0), row("verify", native, None, 70.0),
            row("commit", native, None, 30.0), row("commit", "ours-compact", None, 20.0),
            row("spec_round", "ours-compact", "exact", 80.0), row("verify", "ours-compact", "exact", 60.0),
            row("spec_round", "ours-compact", "fast", 50.0), row("verify", "ours-compact", "fast", 30.0),
            row("verify", "ours-compact", "tile", 40.0, "verify_window(records,BV8xW1)")]
    result = dict(gpu="GPU", date="2026-12-02", commit="abc", copy_bw_gbps=4000.0, state_dtypes=["float32"],
                  draft_tokens=[4], rows=rows)
    bench_compact.write_report(result, str(tmp_path))
    assert json.loads((tmp_path / "compact_h200.json").read_text())["rows"] == rows
    table = (tmp_path / "compact_h200.md").read_text()
    assert ("| gdn | float32 | 4 | 64 | 100.0 | 80.0 | 1.25× | 50.0 | 2.00× | 70.0 + 30.0 | 60.0 + 20.0 "
            "| 30.0 + 20.0 | 0.50 | 0.50 | 0.50 | 0.20× |") in table
    assert "| gdn | float32 | 4 | 64 | verify_window(records,BV8xW1) | 40.0 | 1.50× |" in table
    assert (tmp_path / "compact_h200.png").stat().st_size > 0


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
    for bad in ("tests:shard=0/3", "tests:shard=4/3", "tests:shard=a/b", "tests:shard=2", "tests:shard=10/09",
                "tests:shard=08/09", "tests:shard="):
        proc = _run("bash", "scripts/gpu_suite.sh", "tests", bad, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
        assert proc.returncode == 2 and "a shard is I/N with 1 <= I <= N" in proc.stderr, bad


def test_gpu_shards_split_the_selected_tests_without_overlap():
    """``--gpu-shard I/N`` (scripts/gpu_suite.sh tests:shard=I/N) keeps every N-th of the tests -m selected, from the
    I-th: the shards together are the selection, each test in one of them; a bad value is a usage error."""
    def collected(*extra):
        proc = _run(sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                    "tests/test_replay_write_through.py", *extra)
        return proc, [line for line in proc.stdout.splitlines() if "::" in line]
    _, everything = collected()
    shards = [collected(f"--gpu-shard={i}/3")[1] for i in (1, 2, 3)]
    assert len(everything) >= 3 and sorted(sum(shards, [])) == sorted(everything)
    assert shards[0] == everything[0::3] and shards[2] == everything[2::3]
    proc, _ = collected("--gpu-shard=4/3")
    assert proc.returncode != 0 and "expected I/N with 1 <= I <= N" in proc.stderr


import bench_replay  # noqa: E402


def test_bench_replay_variants_name_the_launch_options():
    p = bench_replay.argparse.ArgumentParser()
    assert bench_replay.parse_variants(p, ["16x1", "32x2:w1:fma", "64x4:dot", "16x1:inorder", "16x1:foldfirst"]) == [
        ("16x1", dict(block_v=16, num_warps=1)),
        ("32x2:w1:fma", dict(block_v=32, num_warps=2, window_warps=1, dot=False)),
        ("64x4:dot", dict(block_v=64, num_warps=4, dot=True)),
        ("16x1:inorder", dict(block_v=16, num_warps=1, fold_first=False)),
        ("16x1:foldfirst", dict(block_v=16, num_warps=1, fold_first=True))]
    assert bench_replay.parse_variants(p, ["served:one", "16x1:two"]) == [
        ("served:one", dict(launches=1)), ("16x1:two", dict(block_v=16, num_warps=1, launches=2))]
    assert bench_replay.parse_variants(p, ["served:nopdl", "served:inorder:pdl"]) == [
        ("served:nopdl", dict(pdl=False)), ("served:inorder:pdl", dict(fold_first=False, pdl=True))]
    assert bench_replay.parse_variants(p, ["served", "served:inorder", "16x1:k128:s2", "64x1:k32:s4:w2"]) == [
        ("served", {}), ("served:inorder", dict(fold_first=False)),
        ("16x1:k128:s2", dict(block_v=16, num_warps=1, block_k=128, num_stages=2)),
        ("64x1:k32:s4:w2", dict(block_v=64, num_warps=1, block_k=32, num_stages=4, window_warps=2))]
    assert bench_replay.parse_variants(p, ["served:through", "served:nothrough", "16x1:nothrough"]) == [
        ("served:through", dict(write_through=True)), ("served:nothrough", dict(write_through=False)),
        ("16x1:nothrough", dict(block_v=16, num_warps=1, write_through=False))]
    assert bench_replay.parse_variants(p, ["served:through:vk", "64x2:through:kv:s2"]) == [
        ("served:through:vk", dict(write_through=True, v_major=True)),
        ("64x2:through:kv:s2", dict(block_v=64, num_warps=2, write_through=True, v_major=False, num_stages=2))]
    assert bench_replay.parse_variants(p, ["served:through:prefetch"]) == [
        ("served:through:prefetch", dict(write_through=True, prefetch=True))]
    assert bench_replay.parse_variants(p, ["served:keyhead", "32x1:valuehead:two"]) == [
        ("served:keyhead", dict(window_key_heads=True, launches=2)),
        ("32x1:valuehead:two", dict(block_v=32, num_warps=1, window_key_heads=False, launches=2))]
    assert bench_replay.parse_variants(p, ["served:rawkeys", "16x1:normkeys"]) == [
        ("served:rawkeys", dict(window_raw_keys=True, launches=2)),
        ("16x1:normkeys", dict(block_v=16, num_warps=1, window_raw_keys=False, launches=2))]
    with pytest.raises(SystemExit):  # the one-launch kernel has no window launch to read raw keys
        bench_replay.parse_variants(p, ["served:rawkeys:one"])
    assert bench_replay.parse_variants(p, ["served:f32", "16x1:f8:one"]) == [
        ("served:f32", dict(fold_block_v=32)),
        ("16x1:f8:one", dict(block_v=16, num_warps=1, fold_block_v=8, launches=1))]
    for bad in ("served:f12", "served:through:f8"):  # not a power of two offered; a write-through folds no window
        with pytest.raises(SystemExit):
            bench_replay.parse_variants(p, [bad])
    assert bench_replay.parse_variants(p, ["served:h4", "32x1:h0:w1"]) == [
        ("served:h4", dict(window_history_rows=4, launches=2)),
        ("32x1:h0:w1", dict(block_v=32, num_warps=1, window_history_rows=0, launches=2, window_warps=1))]
    for bad in ("served:h4:one", "served:h3", "served:h32"):  # no window launch; not offered
        with pytest.raises(SystemExit):
            bench_replay.parse_variants(p, [bad])
    assert bench_replay.parse_variants(p, ["served:stepcursor", "served:layercursor"]) == [
        ("served:stepcursor", dict(cursor="step")), ("served:layercursor", dict(cursor="layer"))]
    with pytest.raises(SystemExit):  # a write-through leaves no cursor to settle
        bench_replay.parse_variants(p, ["served:through:layercursor"])


def test_bench_replay_refuses_a_key_head_window_it_cannot_run():
    """``:keyhead`` is GDN's window launch of two: with ``:one`` or a KDA case the bench stops before any GPU work."""
    p = bench_replay.argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        bench_replay.parse_variants(p, ["served:keyhead:one"])
    with pytest.raises(SystemExit):
        bench_replay.parse_variants(p, ["served:valuehead:one"])
    proc = _run(sys.executable, "scripts/bench_replay.py", "--out", "/tmp/unused", "--variants", "served:keyhead")
    assert proc.returncode == 2 and "pass --families gdn" in proc.stderr
    proc = _run(sys.executable, "scripts/bench_replay.py", "--out", "/tmp/unused", "--variants", "served:h4")
    assert proc.returncode == 2 and "add :valuehead" in proc.stderr  # GDN's served window runs per key head


def test_bench_replay_refuses_to_run_without_a_gpu():
    proc = _run(sys.executable, "scripts/bench_replay.py", "--out", "/tmp/unused")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_bench_replay_report_from_rows(tmp_path):
    base = dict(family="kda", state_dtype="float32", batch=128, draft_tokens=1, bytes_min=1, bytes_per_request=1,
                path="p")
    rows = [dict(base, op="decode", impl="sglang-0.5.14-native", history=None, fold=None, median_us=140.0,
                 frac_copy_bw=0.9),
            dict(base, op="decode", impl="ours-replay", history=16, fold="fused 32x4", median_us=100.0,
                 frac_copy_bw=0.7, verify_kernel_resources="168 regs, 0 spills",
                 kernel_us={"window": 20.0, "output": 78.5}),
            dict(base, op="decode", impl="ours-replay", history=16, fold="separate", median_us=175.0, frac_copy_bw=0.4),
            dict(base, op="decode", impl="ours-replay", history=32, fold="fused 32x4", median_us=112.0,
                 frac_copy_bw=0.7),
            dict(base, op="decode", impl="upstream-replayssm", history=16, fold="upstream", median_us=120.0,
                 frac_copy_bw=0.6, kernel_us={"upstream": 110.0}),
            dict(base, op="decode", impl="fla", history=None, fold="fla", median_us=150.0, frac_copy_bw=0.85,
                 kernel_us={"fla": 145.0})]
    bench_replay.write_report(dict(gpu="GPU", date="d", commit="c", copy_bw_gbps=4000.0, upstream="sglang-0.5.23-x.whl",
                                   fla="fla_core-0.6.0-y.whl", rows=rows), str(tmp_path))
    table = (tmp_path / "replay_h200.md").read_text()
    assert ("| kda | float32 | 1 | 16 | 128 | fused 32x4 | 140.0 | 100.0 | 1.40× | 0.90 | 0.70 "
            "| window 20.0 + output 78.5 | 168 regs, 0 spills |") in table
    assert "| kda | float32 | 1 | 16 | 128 | separate | 140.0 | 175.0 | 0.80× |" in table
    assert "| kda | float32 | 1 | 32 | 128 | fused 32x4 | 140.0 | 112.0 | 1.25× |" in table
    assert ("| kda | float32 | 1 | 16 | 128 | upstream | 140.0 | 120.0 | 1.17× | 0.90 | 0.60 "
            "| upstream 110.0 |") in table
    assert "| kda | float32 | 1 | – | 128 | fla | 140.0 | 150.0 | 0.93× | 0.90 | 0.85 | fla 145.0 |" in table
    assert "(sglang-0.5.23-x.whl)" in table and "(fla_core-0.6.0-y.whl:" in table
    assert (tmp_path / "replay_h200.png").stat().st_size > 0


def test_bench_replay_merges_runs_that_split_the_cases(tmp_path, capsys):
    base = dict(op="decode", state_dtype="float32", batch=8, draft_tokens=1, bytes_min=1, bytes_per_request=1, path="p")
    runs = []
    for i, family in enumerate(("gdn", "kda")):
        rows = [dict(base, family=family, impl="sglang-0.5.14-native", history=None, fold=None, median_us=10.0,
                     frac_copy_bw=0.5),
                dict(base, family=family, impl="ours-replay", history=16, fold="fused served", median_us=20.0 + i,
                     frac_copy_bw=0.3)]
        runs.append(tmp_path / f"{family}.json")
        runs[-1].write_text(json.dumps(dict(gpu="GPU", date=f"d{i}", commit="c", copy_bw_gbps=4000.0 + i, rows=rows)))
    assert bench_replay.main(["--out", str(tmp_path / "out"), "--merge", *map(str, runs)]) == 0
    merged = json.loads((tmp_path / "out" / "replay_h200.json").read_text())
    assert len(merged["rows"]) == 4 and merged["copy_bw_gbps_runs"] == [4000.0, 4001.0] and merged["date"] == "d1"
    table = (tmp_path / "out" / "replay_h200.md").read_text()
    assert "| gdn | float32 | 1 | 16 | 8 | fused served | 10.0 | 20.0 | 0.50× |" in table
    assert "| kda | float32 | 1 | 16 | 8 | fused served | 10.0 | 21.0 | 0.48× |" in table
    other = json.loads(runs[1].read_text())
    (tmp_path / "other.json").write_text(json.dumps(dict(other, commit="d")))
    for bad, why in (([runs[0], runs[0]], "more than one run"), ([runs[0], tmp_path / "missing.json"], "missing.json"),
                     ([runs[0], tmp_path / "other.json"], "differ in commit")):
        with pytest.raises(SystemExit):
            bench_replay.main(["--out", str(tmp_path / "bad"), "--merge", *map(str, bad)])
        assert why in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_record_bytes_match_the_sizing_model():
    from sglang_ssm_modes.sizing.bytes import record_bytes

    for family, kg in (("gdn", 1), ("kda", 128)):
        hk, hv = bench_replay.FAMILIES[family]["hk"], bench_replay.FAMILIES[family]["hv"]
        parts = bench_replay.record_bytes(family)
        assert parts["all"] == record_bytes(
            "replay", head_k_dim=128, head_v_dim=128, gate_width=kg, activation_dtype=torch.bfloat16,
            num_v_heads=hv, num_k_heads=hk)
        # the hot path reads u and the normalised key, a fold the raw inputs and beta; both read g
        assert parts["hot"] == hv * 128 * 4 + hk * 128 * 4 + hv * kg * 4
        assert parts["hot"] - parts["hot_raw_keys"] == hk * 128 * 2  # raw bfloat16 keys, not normalised float32
        assert parts["hot"] + parts["fold"] == parts["all"] + hv * kg * 4


import replay_drift  # noqa: E402


def test_replay_drift_report(tmp_path):
    rows = [dict(family="gdn", tokens=t, impl=impl, history=16, rel_err=err * t)
            for t in (500, 1000) for impl, err in (("sglang-0.5.14-native-bf16", 1e-5), ("ours-replay-bf16", 2e-6))]
    replay_drift.write_report(dict(gpu="GPU", date="d", commit="c", rows=rows), str(tmp_path))
    assert "| gdn | 1000 | 0.01 | 0.002 |" in (tmp_path / "replay_drift.md").read_text()
    assert (tmp_path / "replay_drift.png").stat().st_size > 0


def test_kernel_registers_compiles_the_verify_kernels_for_sm90_on_any_machine():
    """The CPU-side register probe: Triton compiles the replay verify's window and output kernels for
    sm_90a and the wheel's ptxas reports their allocation (what the GPU bench reads from the loaded
    kernels). Run outside the interpreter these tests use (a compiled kernel, not an interpreted one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = _run(sys.executable, "scripts/kernel_registers.py", "--tilings", "wide", "16x1:k128:s2", "--families", "kda",
                env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|") for line in proc.stdout.strip().splitlines()[-2:]]
    assert [[c.strip() for c in row[1:6]] for row in rows] == [["kda", "float32", "16", "fused", "wide"],
                                                                ["kda", "float32", "16", "fused", "16x1:k128:s2"]]
    for row in rows:
        for cell in row[6:8]:
            regs, spills = (int(x) for x in cell.split("/"))
            assert 16 <= regs <= 255 and spills >= 0
    proc = _run(sys.executable, "scripts/kernel_registers.py", "--tilings", "16x1", "--draft-tokens", "1",
                "--one-launch", "--write-through", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header, _, row = proc.stdout.strip().splitlines()[-3:]
    assert "one-launch kernel regs / spills" in header and "write-through kernel regs / spills" in header
    assert len(row.split("|")) == 11
    regs, spills = (int(x) for x in row.split("|")[-2].split("/"))
    assert 16 <= regs <= 255 and spills == 0, "the write-through holds SGLang's decode tile without spilling"
    proc = _run(sys.executable, "scripts/kernel_registers.py", "--tilings", "16x1", "--draft-tokens", "4",
                "--write-through", env=env)  # the write-through verify: its served tile, no spills either
    assert proc.returncode == 0, proc.stderr[-2000:]
    regs, spills = (int(x) for x in proc.stdout.strip().splitlines()[-1].split("|")[-2].split("/"))
    assert 16 <= regs <= 255 and spills == 0


def test_kernel_registers_compiles_the_prefetching_verifies_for_sm90():
    """The verifies' one-step-ahead input loads (not served) compile for sm_90a — compact's verify, chain and tree,
    and the write-through verify (the CPU interpreter runs code the compiler refuses, e.g. a name bound in only
    one branch of a condition that is not a constexpr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = _run(sys.executable, "scripts/kernel_registers.py", "--verify-window", "16x1", "--prefetch", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("| gdn | float32 | 4 | 16x1 prefetch | ")
    proc = _run(sys.executable, "scripts/kernel_registers.py", "--tilings", "narrow", "--write-through", "--prefetch",
                env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("| gdn | float32 | 16 | fused | narrow | ")


@pytest.mark.parametrize("bad", [["--tilings", "24x4"], ["--tilings", "32"], ["--tilings", "32x1:k24"],
                                 ["--tilings", "medium"], ["--histories", "12"],
                                 ["--histories", "8", "--draft-tokens", "9"], ["--draft-tokens", "0"],
                                 ["--verify-window", "--window-keys", "raw"],
                                 ["--verify-window", "16x1", "--one-launch"],
                                 ["--verify-window", "--write-through"]])
def test_kernel_registers_validates_arguments(bad):
    with pytest.raises(SystemExit):
        kernel_registers.main(bad)


import bench_commit  # noqa: E402


GPU_SCRIPT_BAD_ARGUMENTS = [
    *(("bench_replay", bad) for bad in (
        ["--histories", "4", "--draft-tokens", "8"], ["--histories", "12"], ["--draft-tokens", "0"],
        ["--variants", "24x4"], ["--variants", "32"], ["--variants", "32x3"], ["--variants", "16x1:w3"],
        ["--variants", "16x1:x"], ["--variants", "8x1:dot"], ["--variants", "16x1:k24"], ["--variants", "served:s9"],
        ["--variants", "served:through:inorder"], ["--variants", "served:through:k32"], ["--variants", "served:vk"],
        ["--variants", "16x1:nothrough:kv"], ["--variants", "served:prefetch"])),
    *(("replay_drift", bad) for bad in (["--tokens", "0"], ["--history", "12"], ["--families", "mamba"])),
    *(("bench_commit", bad) for bad in (["--layers", "0"], ["--iters", "0"], ["--draft-tokens", "1"],
                                        ["--batches", "0"], ["--history", "12"], ["--track", "sometimes"],
                                        ["--families", "mamba"])),
]


@pytest.mark.parametrize("script,bad", GPU_SCRIPT_BAD_ARGUMENTS)
def test_gpu_scripts_validate_arguments_before_looking_for_a_gpu(script, bad, monkeypatch, capsys):
    module = {"bench_replay": bench_replay, "replay_drift": replay_drift, "bench_commit": bench_commit}[script]
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: True)  # only the argument can refuse
    with pytest.raises(SystemExit) as exc:
        module.main(["--out", "/tmp/unused", *bad])
    assert exc.value.code == 2 and "needs a CUDA GPU" not in capsys.readouterr().err


def test_bench_commit_report_from_rows(tmp_path):
    rows = [dict(op="commit", family="gdn", mode=m, impl=i, state_dtype="float32", batch=8, draft_tokens=4,
                 track=False, host_us=h, span_us=s, launches=n, kernels=["k"], path="p")
            for m, i, h, s, n in (("native", "sglang-0.5.14-native", 60.0, 100.0, 4),
                                  ("compact", "ours-compact", 70.0, 110.0, 3),
                                  ("replay", "ours-replay", 65.0, 20.0, 3))]
    meta = dict(gpu="GPU", date="2026-12-05", commit="abc", layers=36, draft_tokens=4, history=16,
                state_dtype="float32")
    bench_commit.write_report(str(tmp_path), meta, rows)
    assert json.loads((tmp_path / "commit_h200.json").read_text())["rows"] == rows
    table = (tmp_path / "commit_h200.md").read_text()
    assert "| gdn | False | 8 | compact | 70.0 | 110.0 | 3 | 1.10 |" in table
    assert "| gdn | False | 8 | replay | 65.0 | 20.0 | 3 | 0.20 |" in table
    assert (tmp_path / "commit_h200.png").stat().st_size > 0
