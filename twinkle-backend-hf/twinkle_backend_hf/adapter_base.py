"""How an adapter names its base model (``base_model_name_or_path`` in ``adapter_config.json``), and how that name is
read back, so that a run folder can be moved or copied whole and its adapters still find their base.

Written (:func:`recorded_base`):

- a base directory inside the folder that holds the adapter's checkpoint (the run folder: ``OUTPUT_DIR/base``,
  saved by the run because its base was built from a config, or any base the user keeps there) is recorded
  **relative to the adapter directory** (``../base``): it moves with the run folder;
- any other local directory is recorded as an absolute path: moving the run folder does not move it;
- a hub id (``hf://org/name``) is recorded as ``org/name``, what transformers and peft read as a hub id.

Read (:func:`resolve_recorded_base`): a relative path is taken relative to the adapter directory first and, for
adapters written before this rule, relative to the current directory.

Plain peft: ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), ADAPTER)`` ignores the field and
always works. ``AutoPeftModelForCausalLM.from_pretrained(ADAPTER)`` reads it relative to the current directory, so
with a relative record it works from inside the adapter directory (or pass the base yourself, as above).
"""

from __future__ import annotations

import os
from pathlib import Path

#: where a run saves a base model that exists nowhere else (built from a config), inside its output directory
SAVED_BASE_NAME = "base"
HUB_PREFIX = "hf://"


def recorded_base(base: str, adapter_dir: str) -> str:
    """What ``adapter_config.json`` records for ``base`` (a local directory or ``hf://org/name``) of the adapter
    written to ``adapter_dir`` (a staging directory beside the final one is fine: only its parent matters)."""
    if base.startswith(HUB_PREFIX):
        return base[len(HUB_PREFIX):]
    if not os.path.isdir(base):
        return base  # a hub id as transformers takes it
    base_abs = Path(base).resolve()
    adapter_abs = Path(adapter_dir).resolve()
    run_folder = adapter_abs.parent
    if base_abs == run_folder or run_folder in base_abs.parents:
        return os.path.relpath(base_abs, adapter_abs)
    return str(base_abs)


def resolve_recorded_base(recorded: str, adapter_dir: str | os.PathLike[str]) -> str:
    """The base ``recorded`` in the adapter at ``adapter_dir``: an existing directory (relative records resolved
    against the adapter directory, else the current directory), or ``recorded`` unchanged (a hub id, or a
    directory that is gone: the caller names the fix)."""
    path = Path(recorded).expanduser()
    if path.is_absolute():
        return str(path)
    beside = Path(adapter_dir) / path
    if beside.is_dir():
        return str(beside.resolve())
    if path.is_dir():
        return str(path.resolve())
    return recorded
