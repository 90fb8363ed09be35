"""A static HTML page: headed sections of text, tables and images (PNG files beside the page).

Images are referenced by relative path, so a report directory can be copied or served as it is.
"""
from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from pfedkit.atomic import atomic_write_text

STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;margin-top:2em}h3{font-size:1.05em}
img{max-width:100%;margin:.5em 0;border:1px solid #eee}table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right}th{background:#f4f4f4}p.note{color:#555;font-size:.9em}"""


@dataclass
class Section:
    heading: str
    text: str = ""
    images: list[Path] = field(default_factory=list)
    tables: list[pd.DataFrame] = field(default_factory=list)
    links: list[tuple[str, Path]] = field(default_factory=list)
    level: int = 2


def render(title: str, sections: list[Section], path: Path) -> Path:
    """Write the page to `path`; image and link paths are made relative to its folder."""
    folder = path.parent
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"]
    for section in sections:
        parts.append(f"<h{section.level}>{html.escape(section.heading)}</h{section.level}>")
        if section.text:
            parts.append(f"<p class='note'>{html.escape(section.text)}</p>")
        for table in section.tables:
            parts.append(table.to_html(na_rep="-", float_format=lambda v: f"{v:.2f}", border=0))
        if section.links:
            parts.append("<p>" + " · ".join(f"<a href='{html.escape(relative(target, folder))}'>{html.escape(label)}</a>"
                                            for label, target in section.links) + "</p>")
        for image in section.images:
            parts.append(f"<img src='{html.escape(relative(image, folder))}' alt='{html.escape(Path(image).stem)}'>")
    parts.append("</body></html>")
    atomic_write_text(path, "\n".join(parts))
    return path


def relative(target: Path, folder: Path) -> str:
    return Path(os.path.relpath(Path(target).resolve(), folder.resolve())).as_posix()


def referenced_files(page: Path) -> list[Path]:
    """Every file an HTML page refers to by src= or href= (for checks that a page is complete)."""
    import re

    text = page.read_text()
    return [(page.parent / target).resolve() for target in re.findall(r"(?:src|href)='([^']+)'", text)]
