"""One way to build an HTML table, for every page and notebook view the kit shows.

The check report, the grades page, the preflight and tuning reports and the live panel all show
tables, and several hold text we do not control (a learner's error message, a submission's
name, a hostname). So every cell is escaped unless it is marked as HTML the caller built
(`Html`, whose own parts the caller has escaped); attribute values are always escaped.

    html_table(["rank", "state"], [[0, Html("<b>running</b>")]], attrs={"style": "border-collapse:collapse"})
"""
from __future__ import annotations

import html
from typing import Iterable, Mapping, Sequence

Attrs = Mapping[str, object]


class Html(str):
    """Text that is already HTML, built by the caller with its own parts escaped: kept as it is."""


def escape(value: object) -> str:
    """`value` as HTML text: escaped, unless it is Html already."""
    return value if isinstance(value, Html) else html.escape(str(value))


def attributes(attrs: Attrs | None) -> str:
    """` name='value'` for each attribute, values escaped (quotes too)."""
    return "".join(f" {name}='{html.escape(str(value), quote=True)}'" for name, value in (attrs or {}).items())


def html_table(head: Sequence[object] | None, rows: Iterable[Sequence[object]], *, attrs: Attrs | None = None,
               th: Attrs | None = None, td: Attrs | Sequence[Attrs | None] | None = None,
               row_attrs: Sequence[Attrs | None] | None = None) -> Html:
    """A <table> with a <thead> row of `head` (none if None) and a <tbody> row per item of `rows`.

    attrs: the table's attributes; th: every header cell's; td: every cell's, or a sequence of
    them, one per column (a column with None has none); row_attrs: one per row (class, data-*).
    """
    per_column = td is not None and not isinstance(td, Mapping)
    body = []
    for i, row in enumerate(rows):
        cells = "".join(f"<td{attributes(td[j] if per_column else td)}>{escape(c)}</td>"  # type: ignore[index]
                        for j, c in enumerate(row))
        extra = attributes(row_attrs[i]) if row_attrs else ""
        body.append(f"<tr{extra}>{cells}</tr>")
    header = ""
    if head is not None:
        header = "<thead><tr>" + "".join(f"<th{attributes(th)}>{escape(h)}</th>" for h in head) + "</tr></thead>"
    return Html(f"<table{attributes(attrs)}>{header}<tbody>{''.join(body)}</tbody></table>")
