"""``twinkle train`` that SIGKILLs itself at a chosen moment: no handler, no ``finally``, no flush runs.

    python kill_train.py WHEN -- train RECIPE [overrides ...] [--resume latest]

WHEN is one of
  ``never``                  run to the end
  ``step:N``                 inside the forward pass of optimizer step N (mid-training)
  ``save:N:before-marker``   during the N-th checkpoint write: every file written, the marker not yet
  ``save:N:after-rename``    during the N-th checkpoint write: renamed into place, its parent not yet fsynced
"""

from __future__ import annotations

import os
import signal
import sys


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install(when: str) -> None:
    if when == "never":
        return
    kind, _, rest = when.partition(":")
    if kind == "step":
        from twinkle_core.model.torch_model import TorchTwinkleModel

        target = int(rest)
        forward_backward = TorchTwinkleModel.forward_backward
        calls = {"n": 0}

        def dying_forward_backward(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == target:  # one micro-batch per step in the test recipe
                _die()
            return forward_backward(self, *args, **kwargs)

        TorchTwinkleModel.forward_backward = dying_forward_backward
        return
    if kind == "save":
        from twinkle_core import checkpoint

        count, _, stage = rest.partition(":")
        target, seen = int(count), {"manifests": 0, "renames": 0}
        if stage == "before-marker":
            manifest = checkpoint.manifest

            def dying_manifest(root, **kwargs):
                seen["manifests"] += 1
                if seen["manifests"] == target:
                    _die()
                return manifest(root, **kwargs)

            checkpoint.manifest = dying_manifest
            return
        if stage == "after-rename":
            fsync = checkpoint._fsync

            def dying_fsync(directory):
                # atomic_directory fsyncs the staging tree (".incomplete") before the rename, the parent after it
                if ".incomplete" not in directory:
                    seen["renames"] += 1
                    if seen["renames"] == target:
                        _die()
                return fsync(directory)

            checkpoint._fsync = dying_fsync
            return
    raise SystemExit(f"unknown WHEN {when!r}: see the docstring")


def main() -> int:
    when, separator, *argv = sys.argv[1:]
    if separator != "--":
        raise SystemExit(__doc__)
    _install(when)
    from twinkle_core.cli import main as twinkle

    return twinkle(argv)


if __name__ == "__main__":
    sys.exit(main())
