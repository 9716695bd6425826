"""``python -m sglang_ssm_modes {demo,memory,patch} ...``"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "demo": "the three modes on a tiny hybrid stack, checked against native, plus a memory table",
        "memory": "bytes per request and max running requests per mode for a model",
        "patch": "check / apply / revert the patch files on the installed SGLang 0.5.14 (image route)",
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: python -m sglang_ssm_modes {" + ",".join(commands) + "} [options]\n")
        for name, text in commands.items():
            print(f"  {name:8} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv[0] == "patch":
        from .integration.patching import main as patch_main

        return patch_main(argv[1:])
    from .sizing.cli import main as memory_main

    return memory_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
