"""One report, two renderings: the same sections become ``report.md`` (figures linked by relative path) and one
self-contained ``report.html`` (figures embedded as base64 ``data:`` URIs, inline CSS, no script, no external link,
so the page opens offline and can be mailed as one file).

A section holds paragraphs, bullet items, tables and figures; every table and figure of the Markdown is in the HTML,
cell for cell, because both are rendered from these objects. Cell text is plain except ``**bold**`` (a best mean),
which Markdown keeps and HTML turns into ``<strong>``.
"""

from __future__ import annotations

import base64
import html
import os
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    """A table: ``header`` and ``rows`` of cell strings; ``align`` one of "l" / "r" per column (default: first column
    left, the others right); ``title`` rendered as a heading above it."""

    header: list[str]
    rows: list[list[str]]
    title: str = ""
    align: list[str] | None = None

    def alignment(self) -> list[str]:
        return self.align or ["l"] + ["r"] * (len(self.header) - 1)


@dataclass
class Figure:
    """A PNG at ``path`` (read when the HTML is written), shown with ``caption``."""

    path: Path
    caption: str


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    items: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    subsections: list["Section"] = field(default_factory=list)


def _walk(sections: list[Section], level: int = 2):
    """(section, heading level) of every section and, after each, its subsections, depth first."""
    for section in sections:
        yield section, level
        yield from _walk(section.subsections, level + 1)


def table_markdown(table: Table) -> str:
    """``### title`` (if any), a blank line, then the pipe table; no trailing newline."""
    lines = [f"### {table.title}", ""] if table.title else []
    lines.append("| " + " | ".join(table.header) + " |")
    lines.append("|" + "|".join("---:" if a == "r" else "---" for a in table.alignment()) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    return "\n".join(lines)


def render_markdown(title: str, intro: str, sections: list[Section], out_dir: Path) -> str:
    """The whole report as Markdown; figures are linked relative to ``out_dir`` (where report.md goes)."""
    parts = [f"# {title}", intro]
    for section, level in _walk(sections):
        parts.append(f"{'#' * level} {section.title}")
        parts.extend(section.paragraphs)
        if section.items:
            parts.append("\n".join(f"- {item}" for item in section.items))
        parts.extend(table_markdown(t) for t in section.tables)
        for fig in section.figures:
            ref = Path(os.path.relpath(fig.path, out_dir)).as_posix()
            parts.append(f"![{fig.caption}]({ref})")
    return "\n\n".join(p for p in parts if p) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.92em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.25em 0.7em; }
th { border-bottom: 2px solid #888; }
td.r, th.r { text-align: right; font-variant-numeric: tabular-nums; }
td.r { white-space: nowrap; }
td.l, th.l { text-align: left; }
figure { margin: 0.8em 0 1.6em; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.8em; }
"""


def _inline(text: str) -> str:
    """Escaped text with ``**x**`` as <strong> and ``` `x` ``` as <code>."""
    out = html.escape(text)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def table_html(table: Table) -> str:
    align = table.alignment()
    lines = [f"<h3>{_inline(table.title)}</h3>"] if table.title else []
    lines.append("<table>")
    lines.append("<tr>" + "".join(f'<th class="{a}">{_inline(h)}</th>' for h, a in zip(table.header, align)) + "</tr>")
    for row in table.rows:
        lines.append("<tr>" + "".join(f'<td class="{a}">{_inline(c)}</td>' for c, a in zip(row, align)) + "</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def figure_html(fig: Figure) -> str:
    data = base64.b64encode(Path(fig.path).read_bytes()).decode("ascii")
    caption = html.escape(fig.caption)
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{caption}">'
            f"<figcaption>{caption}</figcaption></figure>")


def render_html(title: str, intro: str, sections: list[Section]) -> str:
    """The whole report as one HTML page with every figure embedded; nothing on it refers outside the file."""
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             f"<title>{html.escape(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
             f"<h1>{html.escape(title)}</h1>", f"<p>{_inline(intro)}</p>"]
    for section, level in _walk(sections):
        level = min(level, 6)  # HTML has no <h7>
        parts.append(f"<h{level}>{_inline(section.title)}</h{level}>")
        parts.extend(f"<p>{_inline(p)}</p>" for p in section.paragraphs)
        if section.items:
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in section.items) + "</ul>")
        parts.extend(table_html(t) for t in section.tables)
        parts.extend(figure_html(f) for f in section.figures)
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


__all__ = ["Figure", "Section", "Table", "render_html", "render_markdown", "table_html", "table_markdown"]
