"""A static HTML page: headed sections of text, tables and images (PNG files beside the page).

Images and links are referenced by relative path, so a report directory (with the run
directories it links to) can be copied or served as it is. Tables are written without the
DataFrame index and without columns that hold nothing (all missing or empty), each inside a
horizontally scrolling box so that a wide table never widens the page. A section can be
collapsed (an HTML <details> block) for what a reader opens on demand: the resolved config,
every column of a table, each seed's figures.
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
img{max-width:100%;margin:.5em 0;border:1px solid #eee}div.table{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right;white-space:nowrap}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}p.note{color:#555;font-size:.9em}
details{margin:.6em 0}summary{cursor:pointer;font-weight:600}
pre{background:#f7f7f7;border:1px solid #eee;padding:.6em;overflow-x:auto;font-size:.85em}"""


@dataclass
class Section:
    heading: str
    text: str = ""
    images: list[Path] = field(default_factory=list)
    tables: list[pd.DataFrame] = field(default_factory=list)
    links: list[tuple[str, Path]] = field(default_factory=list)
    level: int = 2
    preformatted: str = ""  # shown as is, in a monospaced block (a YAML file)
    collapsed: bool = False  # a <details> block whose summary is the heading, closed until clicked


def render(title: str, sections: list[Section], path: Path) -> Path:
    """Write the page to `path`; image and link paths are made relative to its folder."""
    folder = path.parent
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"]
    for section in sections:
        parts += render_section(section, folder)
    parts.append("</body></html>")
    atomic_write_text(path, "\n".join(parts))
    return path


def render_section(section: Section, folder: Path) -> list[str]:
    heading = html.escape(section.heading)
    parts = [f"<details><summary>{heading}</summary>" if section.collapsed
             else f"<h{section.level}>{heading}</h{section.level}>"]
    if section.text:
        parts.append(f"<p class='note'>{html.escape(section.text)}</p>")
    if section.preformatted:
        parts.append(f"<pre>{html.escape(section.preformatted)}</pre>")
    for table in section.tables:
        parts.append(table_html(table))
    if section.links:
        parts.append("<p>" + " · ".join(f"<a href='{html.escape(relative(target, folder))}'>{html.escape(label)}</a>"
                                        for label, target in section.links) + "</p>")
    for image in section.images:
        parts.append(f"<img src='{html.escape(relative(image, folder))}' alt='{html.escape(Path(image).stem)}'>")
    if section.collapsed:
        parts.append("</details>")
    return parts


def table_html(table: pd.DataFrame) -> str:
    """The table without its index (a row number tells the reader nothing) and without empty columns."""
    shown = drop_empty_columns(table)
    body = shown.to_html(index=False, na_rep="-", float_format=lambda v: f"{v:.2f}", border=0)
    return f"<div class='table'>{body}</div>"


def drop_empty_columns(table: pd.DataFrame) -> pd.DataFrame:
    """Columns whose every cell is missing or an empty/blank string are left out."""
    def empty(column: pd.Series) -> bool:
        return bool(column.isna().all() or column.map(lambda v: isinstance(v, str) and not v.strip()
                                                      or pd.isna(v)).all())
    return table[[name for name in table.columns if not empty(table[name])]]


def relative(target: Path, folder: Path) -> str:
    return Path(os.path.relpath(Path(target).resolve(), folder.resolve())).as_posix()
