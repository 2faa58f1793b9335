"""Client side: what a check found, per case, shown as a compact table in JupyterLab.

A CheckResult is what hpdl.check() returns. Tests and the grader read `verdicts`, `score`,
`cases` (CaseResult objects) or `to_dict()`; a notebook shows `_repr_html_()`; a terminal the
plain-text repr. Passing rank counts fold into one row; anything else gets a row per case.
"""
from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field
from enum import Enum

from hpdl.hang import ranks_text
from hpdl.tables import Html, html_table


class Verdict(str, Enum):
    """How one case ended. A str, so `case.verdict == "PASS"` and JSON keep working."""

    PASS = "PASS"    # right
    WRONG = "WRONG"  # a wrong result, or a rule of the exercise broken (then CaseResult.rejected says which)
    ERROR = "ERROR"  # the learner's code raised, or its job died
    HANG = "HANG"    # not finished within the time limit
    SLOW = "SLOW"    # right, but far slower than the reference: advisory, full points

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def earns_points(self) -> bool:
        return self in (Verdict.PASS, Verdict.SLOW)


VERDICTS = tuple(v.value for v in Verdict)
EARNS_POINTS = ("PASS", "SLOW")  # SLOW is advisory: the result was right
_COLOURS = {"PASS": "#1a7f37", "SLOW": "#9a6700", "WRONG": "#cf222e", "ERROR": "#cf222e", "HANG": "#8250df"}


@dataclass
class CaseResult:
    """One case on one rank count, and how it ended."""

    exercise: str
    name: str
    ranks: int
    verdict: str
    points: float
    max_points: float
    hidden: bool = False
    seconds: float = 0.0
    message: str = ""
    hint: str | None = None
    wrong_ranks: list[int] = field(default_factory=list)
    max_error: float | None = None
    error_ranks: list[int] = field(default_factory=list)
    line: dict | None = None  # the learner's line that raised (file, line, func, code)
    stuck: dict[int, str] = field(default_factory=dict)  # rank -> where it was stuck
    finished: list[int] = field(default_factory=list)
    details: str = ""
    params: dict = field(default_factory=dict)  # the case's parameters (n, dtype, root, ...)
    rejected: str | None = None  # the rule broken (e.g. "comm.Allreduce()"), when the code was refused

    def __post_init__(self) -> None:
        self.verdict = Verdict(self.verdict)

    @property
    def key(self) -> str:
        return f"{self.ranks} ranks · {self.name}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stuck"] = {str(k): v for k, v in self.stuck.items()}
        d["key"] = self.key
        return d


@dataclass
class CheckResult:
    """Every case of one hpdl.check() call."""

    exercise: str
    cases: list[CaseResult]
    grade: bool = False
    hidden_not_run: int = 0
    seconds: float = 0.0
    hints: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(c.points for c in self.cases)

    @property
    def max_score(self) -> float:
        return sum(c.max_points for c in self.cases)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.verdict in EARNS_POINTS for c in self.cases)

    @property
    def verdicts(self) -> dict[str, str]:
        """'4 ranks · n=10 float64' -> 'PASS', for every case that ran."""
        return {c.key: c.verdict for c in self.cases}

    def find(self, ranks: int | None = None, name: str | None = None, verdict: str | None = None) -> list[CaseResult]:
        """Cases by rank count, by (part of) their name, by verdict."""
        return [
            c for c in self.cases
            if (ranks is None or c.ranks == ranks) and (name is None or name in c.name)
            and (verdict is None or c.verdict == verdict)
        ]

    def counts(self) -> dict[str, int]:
        out = {v: 0 for v in VERDICTS}
        for c in self.cases:
            out[c.verdict] += 1
        return {k: v for k, v in out.items() if v}

    def to_dict(self) -> dict:
        return {
            "exercise": self.exercise,
            "grade": self.grade,
            "score": self.score,
            "max_score": self.max_score,
            "passed": self.passed,
            "counts": self.counts(),
            "hidden_not_run": self.hidden_not_run,
            "seconds": round(self.seconds, 3),
            "hints": self.hints,
            "cases": [c.to_dict() for c in self.cases],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CheckResult":
        """Rebuild a result from to_dict() (the grader reads them back from JSON)."""
        names = set(CaseResult.__dataclass_fields__)
        cases = []
        for c in data.get("cases", []):
            c = {k: v for k, v in c.items() if k in names}
            c["stuck"] = {int(k): v for k, v in (c.get("stuck") or {}).items()}
            cases.append(CaseResult(**c))
        return cls(data["exercise"], cases, grade=data.get("grade", False),
                   hidden_not_run=data.get("hidden_not_run", 0), seconds=data.get("seconds", 0.0),
                   hints=list(data.get("hints", [])))

    def __bool__(self) -> bool:
        return self.passed

    # -- display --------------------------------------------------------------------------
    def _headline(self) -> str:
        counts = ", ".join(f"{n} {v}" for v, n in self.counts().items())
        mark = "✔" if self.passed else "✘"
        return (f"{mark} {self.exercise}: {_num(self.score)}/{_num(self.max_score)} points ({counts}) "
                f"in {self.seconds:.1f} s")

    def _rows(self) -> list[tuple[str, str, str, str, str]]:
        """(ranks, case, verdict, points, what happened): cases that ended the same way share a row."""
        groups: dict[tuple, list[CaseResult]] = {}
        for c in self.cases:
            groups.setdefault(_group_key(c), []).append(c)
        rows = []
        for key, group in groups.items():
            verdict, message = group[0].verdict, group[0].message
            if len({c.message for c in group}) > 1:
                message = f"e.g. {group[0].name}: {message}"
            sizes = sorted({c.ranks for c in group})
            total = [c for c in self.cases if c.ranks in sizes]
            if len(group) == 1:
                label = group[0].name + (" (hidden)" if group[0].hidden else "")
            elif len(group) == len(total):
                label = f"all {len(group)} cases"
            else:
                label = f"{len(group)} cases" if len(group) > 3 else "; ".join(c.name for c in group)
            points = f"{_num(sum(c.points for c in group))}/{_num(sum(c.max_points for c in group))}"
            rows.append((ranks_text(sizes), label, verdict, points, message))
        return rows

    def _footer(self) -> list[str]:
        hints: dict[str, int] = {}
        for c in self.cases:
            if c.hint:
                hints[c.hint] = hints.get(c.hint, 0) + 1
        notes = [f"Hint{'' if n == 1 else f' ({n} cases)'}: {h}" for h, n in hints.items()]
        notes += list(self.hints)
        if self.hidden_not_run:
            plural = "s" if self.hidden_not_run > 1 else ""
            notes.append(f"{self.hidden_not_run} hidden case{plural} not run here: hidden cases run when your "
                         "instructor grades.")
        return notes

    def __repr__(self) -> str:
        lines = [self._headline()]
        for ranks, name, verdict, pts, text in self._rows():
            lines.append(f"  {ranks:>5} ranks  {verdict:<5}  {pts:>7}  {name}" + (f"\n      {text}" if text else ""))
        lines += [f"  {n}" for n in self._footer()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        e = html.escape
        head = f"<div style='font-weight:600;margin:2px 0 4px'>{e(self._headline())}</div>"
        cells = "padding:2px 8px;text-align:left;vertical-align:top;border-bottom:1px solid #d0d7de"
        text = f"{cells};white-space:pre-wrap;font-family:var(--jp-code-font-family,monospace);font-size:11px"
        rows = []
        for ranks, name, verdict, pts, message in self._rows():
            colour = _COLOURS.get(verdict, "#57606a")
            badge = Html(f"<span style='color:#fff;background:{colour};border-radius:3px;padding:0 5px;"
                         f"font-size:11px;font-weight:600'>{e(verdict)}</span>")
            rows.append([ranks, name, badge, pts, message])  # the learner's text: escaped by html_table
        columns = [{"style": cells}] * 3 + [{"style": f"{cells};white-space:nowrap"}, {"style": text}]
        table = html_table(["ranks", "case", "verdict", "points", "what happened"], rows,
                           attrs={"style": "border-collapse:collapse;font-size:12px"}, th={"style": cells},
                           td=columns)
        notes = "".join(f"<div style='font-size:12px;margin-top:4px'>{e(n)}</div>" for n in self._footer())
        return f"<div class='hpdl-check'>{head}{table}{notes}</div>"


def _group_key(c: CaseResult) -> tuple:
    """Cases that ended the same way: same verdict and message; for WRONG, the same ranks
    wrong with the same hint at the same rank count (the values differ case by case)."""
    if c.verdict == Verdict.WRONG and c.wrong_ranks and not c.rejected:
        return (c.verdict, c.ranks, tuple(c.wrong_ranks), c.hint)
    return (c.verdict, c.message)


def _num(x: float) -> str:
    return f"{x:g}"
