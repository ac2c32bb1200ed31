"""What each plugin kind has registered, generated on the plugin-kind pages from the installed plugins.

An mkdocs hook (listed in ``mkdocs.yml``): a page line ``<!-- registered: model -->`` becomes a table of every
record of that kind (name, distribution, implementation, description), read through
:func:`twinkle_core.plugins.get_plugins` as ``twinkle plugins`` reads them: records only, nothing imported.
The table shows the environment that built the site (CI installs every distribution of the repository).
"""

from __future__ import annotations

import re

from twinkle_core.plugins import get_plugins
from twinkle_core.records import KINDS

MARKER = re.compile(r"^<!-- registered: (\w+) -->$", re.MULTILINE)


def registered_table(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"<!-- registered: {kind} --> is no plugin kind; kinds: {', '.join(KINDS)}")
    records = get_plugins().records(kind)
    if not records:
        return f"*Nothing registers a {kind} in the environment that built this site.*"
    rows = ["| name | distribution | implementation | description |", "| --- | --- | --- | --- |"]
    for name, registered in sorted(records.items(), key=lambda item: item[0].lower()):
        description = " ".join(registered.record.description.split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {registered.plugin.distribution} | `{registered.record.impl}` | {description} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    """mkdocs hook: replace each marker by its table."""
    return MARKER.sub(lambda marker: registered_table(marker.group(1)), markdown)
