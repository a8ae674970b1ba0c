"""The report's HTML pieces: number formats, tables, badges, sections (escaped unless Raw)."""

from __future__ import annotations

from collections.abc import Set
from datetime import datetime, timezone
from html import escape

from wattgate.report.phases import PHASE_COLORS


def fmt(x, digits: int = 3, unit: str = "") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}{unit}"
    return f"{x:,.{digits}f}{unit}" if abs(x) < 1e15 else f"{x:.3g}{unit}"


def pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def table(headers: list[str], rows: list[list], numeric: Set[int] = frozenset()) -> str:
    """Cells are escaped unless wrapped in Raw."""
    head = "".join(
        f'<th class="n">{escape(h)}</th>' if i in numeric else f"<th>{escape(h)}</th>" for i, h in enumerate(headers)
    )
    body = []
    for row in rows:
        cells = []
        for i, c in enumerate(row):
            text = c.html if isinstance(c, Raw) else escape(str(c))
            cells.append(f'<td class="n">{text}</td>' if i in numeric else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


class Raw:
    def __init__(self, html: str):
        self.html = html


def badge(label: str, value: str, kind: str) -> str:
    return f'<span class="{kind}">{escape(label)}: {escape(value)}</span>'


def section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{escape(title)}</h2>{body}</section>'


def note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def phase_name(p: str) -> Raw:
    return Raw(f'<span class="swatch" style="background:{PHASE_COLORS.get(p, "#999")}"></span>{escape(p)}')


def utc_of(t) -> str:
    return "n/a" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
