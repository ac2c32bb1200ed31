"""The training progress bar: tqdm on the main process, shown by default on a terminal.

``TWINKLE_NO_PROGRESS=1`` hides it; it is also hidden when stderr is not a terminal (log files),
in which case the loop logs a line per logging step instead.
"""

from __future__ import annotations

import sys
from typing import Any

from twinkle_core.envflags import env_flag


class _NoBar:
    disable = True

    def update(self, n: int = 1) -> None: ...

    def set_postfix(self, *args: Any, **kwargs: Any) -> None: ...

    def close(self) -> None: ...


def progress_enabled(is_main: bool) -> bool:
    if not is_main or env_flag("TWINKLE_NO_PROGRESS"):
        return False
    stream = sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def progress_bar(total: int, initial: int = 0, *, enabled: bool = True, desc: str = "train") -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, leave=True)
