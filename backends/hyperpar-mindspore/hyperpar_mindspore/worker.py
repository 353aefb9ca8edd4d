"""Entry point of every worker of ``hyperpar run`` on MindSpore:
``python -m hyperpar_mindspore.worker script.py [args]`` (or ``-m module [args]``).

Runs the script as ``python script.py`` would. An exception's traceback goes to
``HYPERPAR_MS_ERROR_FILE`` (for the launcher to show last) and to stderr, rank-prefixed, and the
worker exits with code 1. After the script returns the worker leaves the process group.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m hyperpar_mindspore.worker script.py [args] | -m module [args]",
              file=sys.stderr)
        return 2
    module = argv[0] == "-m"
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    except BaseException:
        text = traceback.format_exc()
        path = os.environ.get("HYPERPAR_MS_ERROR_FILE")
        if path:
            with open(path, "w") as fp:
                fp.write(text)
        prefix = f"[rank{os.environ.get('MS_NODE_ID', '?')}]: "
        sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip().splitlines()))
        sys.stderr.flush()
        return 1
    from hyperpar.platform import get_platform

    platform = get_platform()
    if platform.is_initialized():
        platform.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
