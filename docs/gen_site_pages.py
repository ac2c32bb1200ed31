"""The pages that live outside ``docs/``: the repository's README as the front page, and every backend's,
plugin's and example's README at its own path, with the files they link to (figures, scripts).

An mkdocs hook (listed in ``mkdocs.yml``). The READMEs stay where they are, next to their code, and are the one
copy of their text; the site shows them under the same relative paths, so their relative links work unchanged.
On the front page, links into ``docs/`` (written for readers of the repository) are rewritten to the site's
pages. A relative link to a repository file that no page provides adds that file to the site; a link to
anything else is left alone for ``mkdocs build --strict`` to report.
"""

from __future__ import annotations

import glob
import os
import posixpath
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRONT_PAGE = "index.md"
#: the READMEs shown on the site, as repository paths (and site paths)
README_PATTERNS = ("twinkle-*/README.md", "plugins/*/README.md", "examples/*/README.md")
#: a Markdown link or image target, e.g. ``](docs/recipes.md#resume)`` or ``](curves.png "title")``
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def readme_paths() -> list[str]:
    paths = []
    for pattern in README_PATTERNS:
        paths += [os.path.relpath(path, ROOT).replace(os.sep, "/") for path in glob.glob(os.path.join(ROOT, pattern))]
    return sorted(paths)


def front_page() -> str:
    """README.md for the site: its ``docs/...`` links point at the pages themselves."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        return LINK.sub(lambda link: link.group(0).replace("(docs/", "(", 1), readme.read())


def relative_targets(markdown: str, page_uri: str) -> set[str]:
    """The site paths a page's relative links point at (anchors and external links left out)."""
    targets = set()
    for target in LINK.findall(markdown):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            continue
        path = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target.split("#", 1)[0]))
        targets.add(path)
    return targets


def repository_file(site_path: str) -> str | None:
    """The repository file behind a site path, if it is one outside ``docs/`` (the docs are there already)."""
    if site_path.startswith(("..", "docs/")):
        return None
    path = os.path.join(ROOT, *site_path.split("/"))
    return path if os.path.isfile(path) else None


def on_files(files, config):
    """mkdocs hook: add the front page, the READMEs, and the repository files their links need."""
    files.append(File.generated(config, FRONT_PAGE, content=front_page()))
    for path in readme_paths():
        files.append(File.generated(config, path, abs_src_path=os.path.join(ROOT, path)))
    pages = [file for file in files if file.src_uri.endswith(".md")]
    for page in pages:
        for site_path in sorted(relative_targets(page.content_string, page.src_uri)):
            source = repository_file(site_path)
            if source is not None and files.get_file_from_path(site_path) is None:
                files.append(File.generated(config, site_path, abs_src_path=source))
    return files
