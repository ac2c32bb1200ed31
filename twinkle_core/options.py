"""Check a recipe's free-form options against the component they configure, before anything is built.

The options are bound to the component's signature the way the training loop will call it (as
torchtune validates a config by binding it to its ``_component_``), so a typo fails before launch and
names the recipe key::

    check_options(torch.optim.AdamW, {"bets": [0.9, 0.95]}, where="optimizer.options", positional=1,
                  provided={"lr": "optimizer.lr"})
    # ConfigError: optimizer.options.bets: AdamW has no option 'bets'; did you mean optimizer.options.betas?
    #              known options: amsgrad, betas, ...

A class is checked against its ``__init__``. ``**kwargs`` is followed as far as the source says:

* an ``__init__`` that hands ``**kwargs`` to ``super().__init__(...)`` adds the next ``__init__`` of the
  class's MRO (what it passes there itself is no longer open to the caller);
* one that begins by rejecting them (a top-level ``if kwargs: raise ...``) accepts nothing more;
* any other use (stored, read, passed elsewhere) accepts every name: only the named parameters and the
  missing required arguments can be checked then.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.errors import ConfigError

__all__ = ["Accepted", "accepted_options", "check_options"]

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_REJECTS = "rejects"


@dataclass
class Accepted:
    """The keyword arguments a component takes after its leading positional arguments."""

    names: set[str] = field(default_factory=set)
    required: set[str] = field(default_factory=set)
    #: ``**kwargs`` takes names beyond ``names`` (nothing more can be checked)
    open: bool = False


def _forwards(call: ast.AST, var_keyword: str) -> bool:
    """``call`` is ``super().__init__(<plain positional arguments>, ..., **var_keyword)``."""
    if not isinstance(call, ast.Call) or any(isinstance(a, ast.Starred) for a in call.args):
        return False
    func = call.func
    is_super_init = (isinstance(func, ast.Attribute) and func.attr == "__init__" and isinstance(func.value, ast.Call)
                     and isinstance(func.value.func, ast.Name) and func.value.func.id == "super")
    return is_super_init and any(kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id == var_keyword
                                 for kw in call.keywords)


def _rejects(statement: ast.stmt, var_keyword: str) -> bool:
    """``statement`` is ``if var_keyword: raise ...``."""
    return (isinstance(statement, ast.If) and isinstance(statement.test, ast.Name)
            and statement.test.id == var_keyword and isinstance(statement.body[0], ast.Raise))


def _kwargs_use(fn: Callable[..., Any], var_keyword: str) -> ast.Call | str | None:
    """How ``fn`` uses its ``**var_keyword``: the ``super().__init__`` call it is forwarded to,
    ``_REJECTS`` when ``fn`` refuses any, or ``None`` when the source does not say (or is unavailable)."""
    try:
        definition = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError):  # builtins, classes made at run time, lambdas in expressions
        return None
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    if any(_rejects(statement, var_keyword) for statement in definition.body):
        return _REJECTS
    return next((node for node in ast.walk(definition) if _forwards(node, var_keyword)), None)


def _init_chain(cls: type) -> list[Any]:
    return [vars(klass)["__init__"] for klass in cls.__mro__ if "__init__" in vars(klass)]


def _keyword_parameters(fn: Any, filled_positional: int, filled_names: set[str]) -> tuple[dict[str, bool], str | None]:
    """``fn``'s keyword parameters that its caller leaves open (name -> required), and its ``**kwargs`` name."""
    parameters = list(inspect.signature(fn).parameters.values())
    positional_names = [p.name for p in parameters if p.kind in _POSITIONAL]
    filled = set(positional_names[:filled_positional]) | filled_names
    keywords = {p.name: p.default is inspect.Parameter.empty for p in parameters
                if p.kind in _KEYWORD and p.name not in filled}
    var_keyword = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    return keywords, var_keyword


def accepted_options(component: Any, *, positional: int = 0) -> Accepted:
    """What ``component(<positional arguments>, **options)`` accepts as ``options``.

    ``component``: a class (its ``__init__`` chain) or any callable.
    """
    is_class = inspect.isclass(component)
    accepted = Accepted()
    filled_positional, filled_names = positional + is_class, set()  # a class's __init__ also takes self
    for fn in _init_chain(component) if is_class else [component]:
        if fn is object.__init__:  # object() takes no arguments: nothing more is accepted
            return accepted
        try:
            keywords, var_keyword = _keyword_parameters(fn, filled_positional, filled_names)
        except (TypeError, ValueError):  # an extension type without a signature
            accepted.open = True
            return accepted
        accepted.names |= set(keywords)
        accepted.required |= {name for name, required in keywords.items() if required}
        use = _kwargs_use(fn, var_keyword) if var_keyword else _REJECTS  # without **kwargs: nothing more
        if use is _REJECTS:
            return accepted
        if use is None or not is_class:
            accepted.open = True
            return accepted
        # the next __init__ receives what this one passes explicitly, plus the forwarded **kwargs
        filled_positional = len(use.args) + 1
        filled_names = {kw.arg for kw in use.keywords if kw.arg is not None}
    accepted.open = True  # not reached for classes: object.__init__ ends every MRO
    return accepted


def _describe(component: Any) -> str:
    return getattr(component, "__qualname__", None) or type(component).__name__


def _unknown(key: str, component: Any, where: str, own: list[str], provided: Mapping[str, str]) -> str:
    targets = {**{name: f"{where}.{name}" for name in own}, **provided}  # a close loop key points to its recipe key
    close = difflib.get_close_matches(str(key), list(targets), n=1, cutoff=0.6)
    hint = f"did you mean {targets[close[0]]}? " if close else ""
    return (f"{where}.{key}: {_describe(component)} has no option {key!r}; {hint}"
            f"known options: {', '.join(own) or 'none'}")


def check_options(component: Any, options: Mapping[str, Any], *, where: str,
                  provided: Mapping[str, str] | None = None, positional: int = 0) -> None:
    """Raise :class:`ConfigError` unless ``component(<positional>, **provided, **options)`` binds.

    ``where``: the recipe key of ``options`` (``strategy.options``); ``provided``: keyword arguments
    the caller passes itself, mapped to the recipe key that sets them (``{"lr": "optimizer.lr"}``);
    ``positional``: how many leading positional arguments the caller passes (an optimizer's parameters).
    """
    provided = dict(provided or {})
    accepted = accepted_options(component, positional=positional)
    own = sorted(accepted.names - set(provided))
    problems = []
    for key in options:
        if key in provided:
            problems.append(f"{where}.{key}: is set by the recipe itself; use {provided[key]} instead")
        elif key not in accepted.names and not accepted.open:
            problems.append(_unknown(key, component, where, own, provided))
    missing = sorted(accepted.required - set(options) - set(provided))
    if missing:
        problems.append(f"{where}: {_describe(component)} requires {', '.join(missing)}; set "
                        f"{', '.join(f'{where}.{key}' for key in missing)}")
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else "invalid options:\n  " + "\n  ".join(problems))
