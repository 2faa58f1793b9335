"""The expected answers of an exercise's public cases, as data: what a kit without keys checks against.

`hpdl keys strip` removes each case module's reference(); before it does, it runs the reference
job (reference_job.py with spec["expected_only"]) once per rank count and keeps what every
rank's reference() returned (`write`, then hpdl.keys.expected_answers), packed as plain data
(wire.py), in `<exercise>.expected` beside the public module. A check in that kit reads it back
(`load`, `lookup`) where it would have run the reference: the data holds answers to the public
cases, never the implementation.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from hpdl.errors import HpdlError

SUFFIX = ".expected"


def path_for(module_file: str | Path) -> Path:
    return Path(module_file).with_suffix(SUFFIX)


def key(size: int, name: str) -> str:
    return f"{size}/{name}"


def load(module: ModuleType) -> dict:
    """The stored answers of a public-only module (HpdlError when its data file is missing)."""
    from hpdl.checker import wire

    path = path_for(module.__file__)
    try:
        return wire.unpack(path.read_bytes())
    except (OSError, ValueError, wire.NotPlainData) as exc:
        raise HpdlError(f"{path} (the expected answers of this kit's public cases) could not be read: {exc}. "
                        "Strip the kit again with `hpdl keys strip`, or point the check at the keys "
                        "(HPDL_KEYS=DIR).") from None


def lookup(answers: dict, case, rank: int) -> tuple[object, float]:
    """(expected answer, reference seconds) of `case` on `rank`; KeyError for a case not stored."""
    entry = answers[key(case.size, case.name)]
    return entry["expected"][rank], float(entry["seconds"][rank])


def write(job_dir: str, index: int, rank: int, expected, seconds: float) -> None:
    """Reference side (the checker's own job folder): one rank's answer to one case."""
    from hpdl.checker import wire

    with open(os.path.join(job_dir, f"expected-{index}-{rank}.bin"), "wb") as f:
        f.write(wire.pack({"expected": expected, "seconds": seconds}))
