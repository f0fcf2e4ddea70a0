"""mkdocs hook: the README is the site's home page, so it is written once, where GitHub shows it.

The README links to ``docs/X.md`` and the guides to ``../README.md`` (right on GitHub and in a
checkout); on the site those are ``X.md`` and ``index.md``.
"""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def on_files(files, config):
    page = File.generated(config, "index.md", abs_src_path=os.path.join(_ROOT, "README.md"))
    files.append(page)
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "index.md":
        return re.sub(r"\]\(docs/", "](", markdown)
    return markdown.replace("](../README.md", "](index.md")
