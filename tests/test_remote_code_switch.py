"""Issue 27 point 1: every Hugging Face loader in library code gets the resolved remote-code switch explicitly.

transformers asks "Do you wish to run the custom code? [y/N]" on stdin whenever ``trust_remote_code`` is left
``None`` and a directory (or a config object) names custom code; a piped "y" then runs it whatever
``TWINKLE_TRUST_REMOTE_CODE`` says. So no call of a transformers auto class's ``from_pretrained`` /
``from_config`` in any distribution may leave it out; the plugins' tests plant custom code per loader
(``plugins/twinkle-vlm/tests/test_remote_code.py``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY_ROOTS = [ROOT / "twinkle_core", *sorted(ROOT.glob("twinkle-backend-*/twinkle_backend_*")),
                 *sorted(ROOT.glob("plugins/*/twinkle_*"))]
LOADERS = ("from_pretrained", "from_config")


def _is_transformers_auto(receiver: str) -> bool:
    """``AutoConfig`` / ``transformers.AutoTokenizer`` / an ``auto`` class variable; not peft's or our own."""
    tail = receiver.rsplit(".", 1)[-1]
    return (tail.startswith("Auto") or tail in ("auto", "_auto_class()")) and "Peft" not in receiver


def loader_calls_without_switch() -> list[str]:
    missing = []
    for root in LIBRARY_ROOTS:
        for path in sorted(root.rglob("*.py")):
            if "egg-info" in path.parts:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in LOADERS):
                    continue
                receiver = ast.unparse(node.func.value)
                if not _is_transformers_auto(receiver):
                    continue
                keywords = {k.arg for k in node.keywords}
                if "trust_remote_code" not in keywords and None not in keywords:  # ``**common`` may carry it
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {receiver}.{node.func.attr}")
    return missing


def test_every_auto_loader_passes_the_switch() -> None:
    assert loader_calls_without_switch() == []


def test_the_scan_finds_a_loader_without_the_switch(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "twinkle_demo"
    package.mkdir()
    (package / "load.py").write_text("import transformers\n"
                                     "a = transformers.AutoProcessor.from_pretrained('x')\n"
                                     "b = transformers.AutoConfig.from_pretrained('x', trust_remote_code=False)\n"
                                     "c = peft.PeftModel.from_pretrained(m, 'x')\n")
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY_ROOTS", [package])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert loader_calls_without_switch() == ["twinkle_demo/load.py:2 transformers.AutoProcessor.from_pretrained"]
