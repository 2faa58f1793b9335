"""The one HTML table helper, and the pages built with it: text is escaped, built HTML is kept."""
from __future__ import annotations

import re
from pathlib import Path

from hpdl import grade, panel, preflight, tune
from hpdl.checker.report import CaseResult, CheckResult
from hpdl.tables import Html, html_table

ATTACK = "<script>alert('x')</script>"


def test_cells_are_escaped_unless_marked_as_html():
    page = html_table(["a<b", "b"], [[ATTACK, Html("<b>bold</b>")], [3, None]])
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "<b>bold</b>" in page and "<th>a&lt;b</th>" in page
    assert "<td>3</td><td>None</td>" in page
    assert page.startswith("<table><thead><tr><th>") and page.endswith("</tr></tbody></table>")


def test_attributes_are_escaped_and_may_differ_per_column_and_row():
    page = html_table(None, [[1, 2]], attrs={"style": "x"}, td=[{"style": "a"}, None],
                      row_attrs=[{"data-state": "'><script>"}])
    assert "<thead>" not in page
    assert "<table style='x'><tbody><tr data-state='&#x27;&gt;&lt;script&gt;'><td style='a'>1</td><td>2</td>" in page


def test_the_check_report_escapes_the_learners_text_and_keeps_its_badge():
    r = CheckResult("x", [CaseResult("x", ATTACK, 1, "ERROR", 0, 1, message=ATTACK)])
    page = r._repr_html_()
    assert "<script>" not in page and page.count("&lt;script&gt;") == 2
    assert re.search(r"<span style='color:#fff;background:#cf222e[^>]*>ERROR</span>", page)


def test_the_grades_page_escapes_a_submissions_name_and_status(tmp_path: Path):
    sub = grade.Submission(name=f"{ATTACK}.ipynb", path=tmp_path / "a.ipynb", status=ATTACK, seconds=3)
    page = grade._html([sub], ["ring_allreduce"], {"ring_allreduce": 1.0}, 1.0, "sandboxed (bubblewrap)")
    assert "<script>" not in page
    assert "<a href='#s0'>&lt;script&gt;" in page and "<td style='padding:3px 8px;" in page
    assert "<span style='color:#57606a'>not reached</span>" in page and "<td style" in page and ">3 s</td>" in page


def test_the_panel_escapes_what_a_rank_reports_and_keeps_its_row_marks():
    row = panel.Row(rank=1, state="stuck", detail=ATTACK, step="—", memory="1 MB", gpu="", process=ATTACK)
    page = panel._render([row], "2 ranks")
    assert "<script>" not in page
    assert "<tr class='hpdl-rank' data-rank='1' data-state='stuck'>" in page
    assert "● stuck</b>" in page


def test_preflight_and_tuning_tables_keep_their_cells(tmp_path: Path):
    page = preflight._table(["check", "measured"], [[ATTACK, 1_000_000.0], ["x", None]], ["go", "n/a"])
    assert "<tr class='go'><td>&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;</td><td>1,000,000</td></tr>" in page
    assert "<tr class='n/a'><td>x</td><td>—</td></tr>" in page
    sweep = {"name": "default", "ranks": 2, "sizes": [8, 1024], "seconds": [1e-5, 2e-5]}
    path = tune.report(tmp_path, [sweep], [(1024, "ring"), (None, "recursive_doubling")])
    text = path.read_text()
    assert "<th>message per rank</th><th>algorithm</th>" in text
    assert "<td>≤ 1 KiB</td><td>ring</td>" in text and "<td>larger</td><td>recursive_doubling</td>" in text
