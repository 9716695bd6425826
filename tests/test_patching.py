"""The patch route: strict, idempotent, reversible, pinned to SGLang 0.5.14, valid for `patch -p1`,
and it makes SGLang's own loader register our hooks even where the entry point is filtered out."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sglang_ssm_modes.integration.patching import PATCH_ROOT, installed_sglang_root, run_patch

TARGET = Path("sglang/srt/plugins/__init__.py")


@pytest.fixture
def sglang_copy(tmp_path):
    root, _ = installed_sglang_root()
    for rel in (TARGET, Path("sglang/_version.py")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, tmp_path / rel)
    return tmp_path


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sglang_ssm_modes", "patch", *args], capture_output=True, text=True,
                          timeout=300)


def test_check_apply_is_idempotent_and_revert_restores_bytes(sglang_copy):
    original = (sglang_copy / TARGET).read_bytes()
    proc = _cli("check", "--sglang-root", str(sglang_copy))
    assert proc.returncode == 0 and ": clean" in proc.stdout
    assert _cli("apply", "--sglang-root", str(sglang_copy)).returncode == 0
    patched = (sglang_copy / TARGET).read_bytes()
    assert patched != original and b"sglang_ssm_modes.integration.plugin" in patched
    proc = _cli("apply", "--sglang-root", str(sglang_copy))
    assert proc.returncode == 0 and ": applied" in proc.stdout
    assert (sglang_copy / TARGET).read_bytes() == patched
    assert _cli("revert", "--sglang-root", str(sglang_copy)).returncode == 0
    assert (sglang_copy / TARGET).read_bytes() == original


def test_other_sglang_versions_are_refused(sglang_copy):
    version = sglang_copy / "sglang/_version.py"
    version.write_text(version.read_text().replace("'0.5.14'", "'0.5.23'"))
    proc = _cli("apply", "--sglang-root", str(sglang_copy))
    assert proc.returncode == 2
    assert "installed SGLang is 0.5.23" in proc.stdout and "SGLang 0.5.14 only" in proc.stdout
    assert b"sglang_ssm_modes" not in (sglang_copy / TARGET).read_bytes()


def test_a_modified_file_is_a_conflict_and_nothing_changes(sglang_copy):
    target = sglang_copy / TARGET
    target.write_text(target.read_text().replace("    HookRegistry.apply_hooks()\n",
                                                 "    HookRegistry.apply_hooks()  # x\n"))
    before = target.read_bytes()
    code, report = run_patch("apply", sglang_copy, "0.5.14")
    assert code == 1 and "conflict" in report[-1]
    assert target.read_bytes() == before


def test_patch_files_are_valid_for_gnu_patch():
    if shutil.which("patch") is None:
        pytest.skip("GNU patch not installed")
    root, _ = installed_sglang_root()
    for pfile in sorted((PATCH_ROOT / "sglang-0.5.14").glob("*.patch")):
        proc = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(root), "-i", str(pfile)], capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


DRIVER = textwrap.dedent("""
    import importlib, os, sys, types
    os.environ["SGLANG_PLUGINS"] = "someone_else_only"   # the entry point is filtered out
    import sglang.srt.plugins as original
    patched = types.ModuleType("sglang.srt.plugins")
    patched.__path__ = original.__path__
    patched.__file__ = original.__file__
    sys.modules["sglang.srt.plugins"] = patched
    exec(compile(open(sys.argv[1]).read(), original.__file__, "exec"), patched.__dict__)
    patched.load_plugins()
    import argparse
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    print("RESULT", parser.parse_args(["--model-path", "m", "--ssm-state-mode", "compact"]).ssm_state_mode)
""")


def test_patched_loader_registers_the_hooks_like_the_plugin(sglang_copy):
    assert _cli("apply", "--sglang-root", str(sglang_copy)).returncode == 0
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(sglang_copy / TARGET)], capture_output=True, text=True,
                          timeout=300)
    assert "RESULT compact" in proc.stdout, proc.stdout[-1500:] + proc.stderr[-3000:]
