"""Small HTML building blocks for the report: escaped tables, figures, sections, the page.

Self-contained on purpose: inline CSS, no scripts, no fonts or anything else fetched, images
embedded as base64 PNG data (the PNG files stay beside the page too), so index.html alone reads
anywhere, offline, without scalelab: mailed, attached, moved out of its folder.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

Format = str | Callable[[Any], str]

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial,
       sans-serif; color: #1d232b; background: #fff; margin: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 60px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 20px; margin: 34px 0 8px; padding-bottom: 4px; border-bottom: 2px solid #d7dde5; }
h3 { font-size: 16px; margin: 20px 0 6px; }
p.lead { color: #4a5563; margin: 0 0 14px; }
p.note { color: #4a5563; font-size: 13px; margin: 4px 0 10px; }
nav { font-size: 14px; margin: 10px 0 0; }
nav a { margin-right: 14px; color: #1f5fae; text-decoration: none; }
.scroll { overflow-x: auto; margin: 6px 0 12px; }
table { border-collapse: collapse; font-size: 13px; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d7dde5; padding: 4px 9px; text-align: right; white-space: nowrap; }
th { background: #eef2f7; font-weight: 600; }
td.text, th.text { text-align: left; }
tr:nth-child(even) td { background: #f8fafc; }
td.bad { color: #b3261e; font-weight: 600; }
td.good { color: #1b7a3a; }
td.warn, ul.warn { color: #9a5b00; }
ul.warn { font-size: 13px; margin: 4px 0 10px; }
figure { margin: 10px 0 18px; }
figure img { max-width: 100%; border: 1px solid #e3e8ef; }
figcaption { font-size: 13px; color: #4a5563; margin-top: 4px; }
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: Any, fmt: Format | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if callable(fmt):
        return fmt(value)
    if fmt is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def table(
    df: pd.DataFrame,
    formats: dict[str, Format] | None = None,
    index: bool = False,
    classes: dict[str, Callable[[Any], str]] | None = None,
    text_cols: set[str] | None = None,
) -> str:
    """An HTML table: numbers right-aligned and formatted, text left-aligned, all escaped.

    text_cols: left-aligned columns (default: the non-numeric ones)."""
    formats, classes = formats or {}, classes or {}
    frame = df.reset_index() if index else df
    cols = list(frame.columns)
    if text_cols is None:
        text_cols = {c for c in cols if not pd.api.types.is_numeric_dtype(frame[c])}
    head = "".join(f'<th class="{"text" if c in text_cols else ""}">{esc(c)}</th>' for c in cols)
    rows = []
    for _, row in frame.iterrows():
        cells = []
        for c in cols:
            css = ["text"] if c in text_cols else []
            if c in classes:
                css.append(classes[c](row[c]))
            cells.append(f'<td class="{" ".join(css)}">{esc(_cell(row[c], formats.get(c)))}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    body = "\n".join(rows)
    return f'<div class="scroll"><table>\n<tr>{head}</tr>\n{body}\n</table></div>'


def figure(path: Path, page_dir: Path, caption: str) -> str:
    """The PNG embedded in the page; data-file names the copy beside it."""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    name = path.relative_to(page_dir).as_posix()
    return (
        f'<figure><img src="data:image/png;base64,{data}" data-file="{esc(name)}" '
        f'alt="{esc(caption)}"><figcaption>{esc(caption)}</figcaption></figure>'
    )


def warning_list(items: list[str]) -> str:
    """Warnings in red, one per line (nothing when there are none)."""
    if not items:
        return ""
    lis = "".join(f"<li>{esc(w)}</li>" for w in items)
    return f'<ul class="warn">{lis}</ul>'


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{esc(anchor)}">\n<h2>{esc(title)}</h2>\n{body}\n</section>'


def page(title: str, lead: str, sections: list[tuple[str, str, str]]) -> str:
    """The whole document; sections are (anchor, title, body html)."""
    nav = "".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t, _ in sections)
    body = "\n".join(section(a, t, b) for a, t, b in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
        f'<h1>{esc(title)}</h1>\n<p class="lead">{esc(lead)}</p>\n<nav>{nav}</nav>\n'
        f"{body}\n</main>\n</body>\n</html>\n"
    )
