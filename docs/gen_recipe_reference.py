"""The recipe reference page, generated from the recipe schema at every documentation build.

``twinkle_core/train/recipe/schema.py`` is the one declaration of a recipe's keys: one dataclass per section,
its defaults, and ``#:`` comments for recipe authors. This module renders it as ``recipe-reference.md`` (an
mkdocs hook, listed in ``mkdocs.yml``), so the page cannot drift from the code that validates recipes.
``python docs/gen_recipe_reference.py`` prints the page.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from typing import Any

from twinkle_core.train.recipe import schema

PAGE = "recipe-reference.md"


def key_comments() -> dict[tuple[str, str], str]:
    """``(class name, field name)`` -> the ``#:`` comment lines just above the field, joined."""
    source = inspect.getsource(schema)
    lines = source.splitlines()
    comments = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            above = []
            row = statement.lineno - 2  # the line above the field, 0-based
            while row >= 0 and lines[row].strip().startswith("#:"):
                above.insert(0, lines[row].strip()[2:].strip())
                row -= 1
            comments[(node.name, statement.target.id)] = " ".join(above)
    return comments


def field_types() -> dict[tuple[str, str], str]:
    """``(class name, field name)`` -> the annotation as written in the schema."""
    types = {}
    for node in ast.parse(inspect.getsource(schema)).body:
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    types[(node.name, statement.target.id)] = ast.unparse(statement.annotation)
    return types


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise ValueError(f"recipe key {field.name} has no default; the reference shows every key's default")


def show(value: Any) -> str:
    """A default as a recipe author would write it in YAML."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == {}:
        return "`{}`"
    return f"`{value}`"


def markdown_of(comment: str) -> str:
    """The schema's comments are reStructuredText (``code``, :func:`name`); the page is Markdown."""
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", comment.replace("``", "`"))


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def section_table(config_class: type, prefix: str, comments: dict, types: dict) -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for field in dataclasses.fields(config_class):
        default = default_of(field)
        shown = f"see [`{field.name}`](#{field.name})" if dataclasses.is_dataclass(default) \
            else show(default)
        meaning = markdown_of(comments.get((config_class.__name__, field.name), ""))
        if dataclasses.is_dataclass(default):
            meaning = meaning or "a section: its keys are below"
        if field.metadata.get("path"):
            meaning = (meaning + " " if meaning else "") + "(a path: relative to the recipe file's folder)"
        key_type = types[(config_class.__name__, field.name)]
        rows.append(f"| `{prefix}{field.name}` | `{key_type}` | {cell(shown)} | {cell(meaning)} |")
    return "\n".join(rows)


def render() -> str:
    comments, types = key_comments(), field_types()
    parts = [
        "# Recipe reference",
        "",
        "Every key a recipe takes, with its type and default. This page is generated from "
        "`twinkle_core/train/recipe/schema.py` (the schema `twinkle train` validates against) by "
        "`docs/gen_recipe_reference.py` at every documentation build. Any key can be overridden on the command "
        "line as `section.key=value`; a section with a name takes the name alone (`strategy: ddp`).",
        "",
        "## Top-level keys",
        "",
        section_table(schema.Recipe, "", comments, types),
    ]
    for field in dataclasses.fields(schema.Recipe):
        default = default_of(field)
        if dataclasses.is_dataclass(default):
            parts += ["", f"## `{field.name}`", "", section_table(type(default), f"{field.name}.", comments, types)]
    parts += [
        "",
        "## Names from other frameworks",
        "",
        "A top-level key with one of these names is refused with a suggestion of the Twinkle key:",
        "",
        "| name | Twinkle key |",
        "| --- | --- |",
        *(f"| `{name}` | `{key}` |" for name, key in sorted(schema.ALIASES.items())),
        "",
        "## Keys `model.options` may not set",
        "",
        "The training loop passes these to every model class itself, each from its recipe key:",
        "",
        "| model class argument | recipe key |",
        "| --- | --- |",
        *(f"| `{argument}` | `{key}` |" for argument, key in sorted(schema.CONSTRUCTOR_KEYS_FROM.items())),
    ]
    return "\n".join(parts) + "\n"


def on_files(files, config):
    """mkdocs hook: add the generated page to the site."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render(), end="")
