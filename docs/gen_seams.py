"""The contracts index on the plugin-kind pages, generated from :data:`twinkle_core.contracts.SEAMS`.

An mkdocs hook (listed in ``mkdocs.yml``): a page line ``<!-- seams of: Task -->`` (one or more owners, comma
separated) becomes the seams those classes declare, by lifecycle phase, exactly as
``python -m twinkle_core.contracts`` prints them. An owner with no seam fails the build, so a renamed class
cannot leave an empty table behind.
"""

from __future__ import annotations

import re

from twinkle_core.contracts import SEAMS, render_markdown

MARKER = re.compile(r"^<!-- seams of: ([\w, ]+) -->$", re.MULTILINE)


def seams_table(owners: list[str]) -> str:
    unknown = [owner for owner in owners if not any(seam.owner == owner for seam in SEAMS)]
    if unknown:
        known = sorted({seam.owner for seam in SEAMS})
        raise ValueError(f"<!-- seams of: ... --> names {', '.join(unknown)}, which declare no seam in "
                         f"twinkle_core.contracts.SEAMS; owners with seams: {', '.join(known)}")
    return render_markdown(tuple(seam for seam in SEAMS if seam.owner in owners))


def on_page_markdown(markdown, page, config, files):
    """mkdocs hook: replace each marker by its table."""
    return MARKER.sub(lambda marker: seams_table([owner.strip() for owner in marker.group(1).split(",")]),
                      markdown)
