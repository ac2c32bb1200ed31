"""No hard-coded CUDA outside the CUDA accelerator (issue 12, point 2).

Device and collective choices go through the accelerator contract (``current_accelerator()`` ->
``.device()``, ``.device_type``, ``.dist_backend``, ``.synchronize()`` ...), so another vendor's
accelerator (``npu``, ``xpu``) runs the same code. This test parses the source of the core, the HF
backend and the embedding plugin and fails on code (not comments or docstrings) that names CUDA:

* ``torch.cuda`` / ``torch.backends.cuda`` / ``torch.backends.cudnn`` attribute access, and
  ``import torch.cuda`` / ``from torch.cuda import ...`` / ``from torch import cuda``;
* ``.cuda(...)`` method calls;
* a string literal that *is* a device or backend name: ``"cuda"``, ``"cuda:1"``, ``"nccl"``.

Prose in messages ("on a CUDA GPU") is not a device choice and is not flagged. What legitimately names
CUDA is listed in ``ALLOWED`` with its reason.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the packages whose code must stay vendor-neutral
SCANNED = ("twinkle_core", "twinkle-backend-hf/twinkle_backend_hf", "plugins/twinkle-embedding/twinkle_embedding")

#: (path relative to the repository root, qualified name of a class or function whose body may name CUDA) -> why
ALLOWED: dict[tuple[str, str], str] = {
    ("twinkle_core/accelerator.py", "CUDAAccelerator"):
        "the CUDA accelerator itself: the one place that talks to torch.cuda and picks nccl",
    ("twinkle_core/builtins.py", "twinkle_register_accelerators"):
        "registers the CUDA accelerator under its name 'cuda'",
    ("twinkle_core/builtins.py", "twinkle_select_accelerator"):
        "the core's fallback auto-selection order names its own accelerators ('cuda' before 'cpu')",
    ("twinkle-backend-hf/twinkle_backend_hf/quantization.py", "check_device"):
        "bitsandbytes' kernels are CUDA's own; on any other device its torch path is probed before use",
    ("twinkle-backend-hf/twinkle_backend_hf/quantization.py", "check_export"):
        "GPTQ / AWQ calibration (gptqmodel, autoawq, llm-compressor) needs a CUDA GPU: refused elsewhere by name",
    ("twinkle-backend-hf/twinkle_backend_hf/sequence_parallel/ring_blocks.py", "torch_block_attention"):
        "torch's fused attention ops that return the log-sum-exp are per device: FlashAttention-2 and the "
        "memory-efficient kernel exist for CUDA only, FlashAttention for the CPU under another name",
    ("twinkle-backend-hf/twinkle_backend_hf/sequence_parallel/ring_blocks.py", "default_block_attention"):
        "the devices torch has those fused ops for (CPU and CUDA); any other device keeps the plain products",
}

_DEVICE_LITERAL = re.compile(r"(cuda|nccl)(:\d*)?", re.IGNORECASE)
_CUDA_MODULES = (("cuda",), ("backends", "cuda"), ("backends", "cudnn"))


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    scope: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.scope or '<module>'}: {self.what}"


def _attribute_chain(node: ast.expr) -> list[str]:
    """``torch.backends.cuda.matmul`` -> ["torch", "backends", "cuda", "matmul"] ([] if not a plain chain)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return []
    parts.append(node.id)
    return parts[::-1]


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.torch_names = {"torch"}  # `import torch as th` adds "th"
        self.findings: list[Finding] = []
        self._docstrings: set[int] = set()  # ids of bare string statements (docstrings, block comments in quotes)

    def _add(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), ".".join(self.scope), what))

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            self._docstrings.add(id(node.value))
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "torch" and alias.asname:
                self.torch_names.add(alias.asname)
            if alias.name.split(".")[:2] == ["torch", "cuda"] or alias.name.startswith("torch.backends.cud"):
                self._add(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[:2] == ["torch", "cuda"] or module.startswith("torch.backends.cud"):
            self._add(node, f"from {module} import ...")
        elif module in ("torch", "torch.backends") and any(a.name in ("cuda", "cudnn") for a in node.names):
            self._add(node, f"from {module} import cuda")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _attribute_chain(node)
        # report the shortest CUDA prefix once: torch.cuda.synchronize is one finding, not two
        if chain and chain[0] in self.torch_names and tuple(chain[1:]) in _CUDA_MODULES:
            self._add(node, ".".join(["torch", *chain[1:]]))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda":
            self._add(node, ".cuda() call")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self._docstrings and _DEVICE_LITERAL.fullmatch(
                node.value.strip()):
            self._add(node, f"string literal {node.value!r}")


def scan_source(source: str, path: str = "<snippet>") -> list[Finding]:
    """Every CUDA mention in ``source``'s code (comments and docstrings are not code)."""
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.findings


def allowed_by(finding: Finding) -> tuple[str, str] | None:
    """The ``ALLOWED`` entry that covers ``finding`` (its file, and its scope or an enclosing one), if any."""
    for path, scope in ALLOWED:
        if finding.path == path and (finding.scope == scope or finding.scope.startswith(scope + ".")):
            return path, scope
    return None


def is_allowed(finding: Finding) -> bool:
    return allowed_by(finding) is not None


def scan_packages() -> list[Finding]:
    findings: list[Finding] = []
    for package in SCANNED:
        for file in sorted((ROOT / package).rglob("*.py")):
            relative = file.relative_to(ROOT).as_posix()
            findings.extend(scan_source(file.read_text(encoding="utf-8"), relative))
    return findings


# ---------------------------------------------------------------------- the guard
def test_no_hardcoded_cuda_outside_the_cuda_accelerator():
    offending = [f for f in scan_packages() if not is_allowed(f)]
    assert not offending, (
        "hard-coded CUDA outside the CUDA accelerator; go through twinkle_core.accelerator.current_accelerator() "
        "(.device(), .device_type, .dist_backend, ...) or, if it really is CUDA-only, add an entry with its reason "
        "to ALLOWED in tests/test_no_hardcoded_cuda.py:\n" + "\n".join(map(str, offending)))


def test_every_allowlist_entry_is_still_needed():
    """A stale entry would silently allow a future CUDA call in a scope that no longer needs one."""
    used = {allowed_by(f) for f in scan_packages()}
    stale = [f"{path}: {scope}" for path, scope in ALLOWED if (path, scope) not in used]
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def test_commands_default_to_the_accelerators_device(monkeypatch):
    """``twinkle chat`` / ``twinkle evaluate`` without --device load onto the active accelerator's device."""
    pytest.importorskip("twinkle_backend_hf")  # the commands come with it
    import torch
    from twinkle_backend_hf.commands.checkpoint_loading import default_device

    from twinkle_core import accelerator

    class OtherVendor(accelerator.CPUAccelerator):
        def device(self, local_rank=None):
            return torch.device("xpu", 1)

    monkeypatch.setattr(accelerator, "current_accelerator", OtherVendor)
    assert default_device() == "xpu:1"
    assert default_device("cpu") == "cpu"  # an explicit --device wins


def test_scanned_packages_exist():
    for package in SCANNED:
        assert any((ROOT / package).rglob("*.py")), f"{package} has no Python files: was it moved?"


# ---------------------------------------------------------------------- the scanner itself can fail
@pytest.mark.parametrize(("snippet", "what"), [
    ("import torch\ntorch.cuda.synchronize()\n", "torch.cuda"),
    ("import torch as th\nth.cuda.manual_seed_all(0)\n", "torch.cuda"),
    ("import torch\ntorch.backends.cuda.matmul.allow_tf32 = True\n", "torch.backends.cuda"),
    ("from torch.cuda.amp import GradScaler\n", "from torch.cuda.amp import ..."),
    ("import torch.cuda\n", "import torch.cuda"),
    ("from torch import cuda\n", "from torch import cuda"),
    ("x = model.cuda()\n", ".cuda() call"),
    ("device = 'cuda'\n", "string literal 'cuda'"),
    ("import torch\nd = torch.device('cuda:1')\n", "string literal 'cuda:1'"),
    ("def f(backend):\n    return backend == 'nccl'\n", "string literal 'nccl'"),
    ("d = f'cuda:{rank}'\n", "string literal 'cuda:'"),
    ("import torch\nwith torch.autocast(device_type='cuda'):\n    pass\n", "string literal 'cuda'"),
])
def test_scanner_flags(snippet, what):
    findings = scan_source(snippet)
    assert [f.what for f in findings] == [what], findings


@pytest.mark.parametrize("snippet", [
    '"""Runs on cuda or npu: torch.cuda.synchronize() is never called here."""\n',
    "# torch.cuda.synchronize() would be wrong here\nx = 1\n",
    "def f():\n    '''nccl on GPUs'''\n    return 1\n",
    "raise RuntimeError('flash-attn needs a CUDA GPU')\n",
    "from twinkle_core.accelerator import current_accelerator\ncurrent_accelerator().synchronize()\n",
])
def test_scanner_ignores_prose_and_the_contract(snippet):
    assert scan_source(snippet) == []


def test_allowlist_is_scoped_to_the_named_class():
    source = ("class CUDAAccelerator:\n    def f(self):\n        return torch.cuda.is_available()\n"
              "class Other:\n    def f(self):\n        return torch.cuda.is_available()\n")
    findings = scan_source(source, "twinkle_core/accelerator.py")
    assert [is_allowed(f) for f in findings] == [True, False]
    assert findings[1].scope == "Other.f"
