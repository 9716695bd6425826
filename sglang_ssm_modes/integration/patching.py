"""``python -m sglang_ssm_modes patch {check,apply,revert}``: the second route into SGLang, for users
who bake a patched SGLang into an image. The patch files live in ``patches/sglang-<version>/`` (unified
diffs against the installed ``sglang`` package root, usable with ``patch -p1`` too); this applier is
strict (every context line must match), idempotent, and refuses any SGLang other than the pinned one.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from .. import SUPPORTED_SGLANG_VERSION

PATCH_ROOT = Path(__file__).resolve().parents[2] / "patches"
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+(\d+)(?:,\d+)? @@")


@dataclass(frozen=True)
class Hunk:
    old: list[str]
    new: list[str]


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the directory that holds the ``sglang`` package
    hunks: list[Hunk]


def parse_patch(text: str) -> list[FilePatch]:
    """File patches of a unified diff (``--- a/…``, ``+++ b/…``, hunks of ' ', '-', '+' lines)."""
    files, lines, i = [], text.splitlines(keepends=True), 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].strip().split("\t")[0]
            path = path[2:] if path.startswith("b/") else path
            hunks, i = [], i + 2
            while i < len(lines) and _HUNK.match(lines[i]):
                old, new, i = [], [], i + 1
                while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\n"):
                    tag, body = lines[i][:1], lines[i][1:] if lines[i][:1] != "\n" else "\n"
                    if tag in (" ", "\n", "-"):
                        old.append(body)
                    if tag in (" ", "\n", "+"):
                        new.append(body)
                    i += 1
                hunks.append(Hunk(old, new))
            files.append(FilePatch(path, hunks))
        else:
            i += 1
    return files


def _find(lines: list[str], block: list[str]) -> list[int]:
    n = len(block)
    return [s for s in range(len(lines) - n + 1) if lines[s:s + n] == block]


def file_state(text: str, patch: FilePatch) -> str:
    """"applied", "clean" (applies cleanly) or "conflict" for one file's text."""
    lines = text.splitlines(keepends=True)
    states = set()
    for h in patch.hunks:
        old_at, new_at = _find(lines, h.old), _find(lines, h.new)
        if len(new_at) == 1 and not old_at:
            states.add("applied")
        elif len(old_at) == 1 and not new_at:
            states.add("clean")
        else:
            states.add("conflict")
    return states.pop() if len(states) == 1 else "conflict"


def _rewrite(text: str, patch: FilePatch, forward: bool) -> str:
    lines = text.splitlines(keepends=True)
    for h in patch.hunks:
        src, dst = (h.old, h.new) if forward else (h.new, h.old)
        (start,) = _find(lines, src)
        lines[start:start + len(src)] = dst
    return "".join(lines)


def installed_sglang_root() -> tuple[Path, str]:
    """The directory holding the installed ``sglang`` package, and its version."""
    import sglang

    return Path(sglang.__file__).resolve().parents[1], sglang.__version__


def run_patch(action: str, root: Path, version: str, patch_dir: Path | None = None) -> tuple[int, list[str]]:
    """Check, apply or revert every patch for ``version`` under ``root``. Returns (exit code, report)."""
    if version != SUPPORTED_SGLANG_VERSION:
        return 2, [f"installed SGLang is {version}; these patches are for SGLang {SUPPORTED_SGLANG_VERSION} only: "
                   f"install sglang=={SUPPORTED_SGLANG_VERSION} or use the plugin route"]
    patch_dir = patch_dir or PATCH_ROOT / f"sglang-{version}"
    if not patch_dir.is_dir():
        return 2, [f"no patch files at {patch_dir}: run from a source checkout of sglang-ssm-modes"]
    report, plans = [], []
    for pfile in sorted(patch_dir.glob("*.patch")):
        for fp in parse_patch(pfile.read_text()):
            target = root / fp.path
            if not target.is_file():
                return 2, [f"{pfile.name}: {target} does not exist: is {root} an SGLang {version} install?"]
            text = target.read_text()
            state = file_state(text, fp)
            report.append(f"{pfile.name}: {fp.path}: {state}")
            plans.append((target, text, fp, state))
    if any(state == "conflict" for *_, state in plans):
        return 1, report + ["conflict: the files differ from SGLang's release; nothing was changed"]
    if action == "check":
        return 0, report
    for target, text, fp, state in plans:
        if action == "apply" and state == "clean":
            target.write_text(_rewrite(text, fp, forward=True))
        elif action == "revert" and state == "applied":
            target.write_text(_rewrite(text, fp, forward=False))
    return 0, report + [f"{action}: done"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_ssm_modes patch", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("check", "apply", "revert"))
    p.add_argument("--sglang-root", type=Path, default=None,
                   help="directory holding the sglang package (default: the installed one)")
    args = p.parse_args(argv)
    if args.sglang_root is None:
        root, version = installed_sglang_root()
    else:
        root = args.sglang_root
        version = _version_at(root)
    code, report = run_patch(args.action, root, version)
    print("\n".join(report))
    return code


def _version_at(root: Path) -> str:
    match = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]",
                      (root / "sglang" / "_version.py").read_text())
    if not match:
        raise SystemExit(f"cannot read the SGLang version under {root}/sglang/_version.py")
    return match.group(1)
