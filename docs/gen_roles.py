"""Sphinx cross-reference roles in docstrings (``:class:`~pkg.Name```), shown as plain code on the site.

An mkdocs hook (listed in ``mkdocs.yml``). The project's docstrings use Sphinx roles, which Markdown renders as
the literal role followed by code (``:class:<code>~pkg.Name</code>``); this leaves the code, and drops the
leading ``~`` as Sphinx does (which also shows the last name only).
"""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):<code>(~?)([^<]*)</code>")


def plain_code(role: re.Match) -> str:
    shortened, target = role.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if shortened else target}</code>"


def on_page_content(html, page, config, files):
    """mkdocs hook: rewrite the roles in each page's HTML."""
    return ROLE.sub(plain_code, html)
