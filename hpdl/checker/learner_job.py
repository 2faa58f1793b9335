"""Learner's ranks: run the learner's function on the cases of one rank count, nothing else.

    mpiexec -n P python -m hpdl.checker.learner_job JOB_DIR

This process holds no expected value and no verdict logic: per case it builds this rank's
inputs, calls the learner's function (through the case module's call() when it has one) with
every MPI and torch.distributed call recorded (recording.py), and writes what came back as
plain data (wire.py) to JOB_DIR/r<R>/out-<case>-<rank>.bin, with start/end events in
JOB_DIR/r<R>/rank<R>.jsonl. The checker's reference job compares them; see jobs.py. In a
sandbox, each rank first makes a view of its own (isolate.py) where JOB_DIR holds spec.pkl and
its own r<R> only, and meets the other ranks only through the checker (barrier()).

This process never reads the case module's file (its sandbox hides the kit's case modules and
the instructor's keys): the checker hands it the part of the module that inputs() and call()
use, cut out by split.py, as source in its spec (spec["public"]). Before the learner's code is
unpacked that part is loaded, cut down again (strip_module), importing the kit's case modules or
solutions is refused, and the kit's own implementations of exercises (hooks.KIT_ANSWERS) are
replaced by functions that refuse to run, so the answer key is not within the learner's reach.
"""
from __future__ import annotations

import copy
import functools
import importlib
import importlib.abc
import importlib.util
import os
import sys
import time
import traceback
import types

from hpdl.checker.rank_job import RankJob, learner_traceback, learner_where, main, short, state

KEEP = ("inputs", "call", "serve", "set_up", "calibrate")
MAX_WAITS = 100_000  # completed requests sent back with the calls (rendezvous.py's replay), at most
# hpdl.checker modules of the deciding side (reference ranks, verdicts, the grader): never loaded here
DECIDING_SIDE = {"reference_job", "jobs", "checking", "client", "grade_service"}
_KIT_MODULES: set[str] = set()  # modules whose own answers were replaced (refuse_kit_answers): never loaded afresh


class _NoAnswerKey(importlib.abc.MetaPathFinder):
    """Refuse imports of the kit's case modules (reference solutions) in the learner's process."""

    def find_spec(self, fullname, path, target=None):
        package, _, short_name = fullname.rpartition(".")
        if fullname in _KIT_MODULES:
            raise ImportError(f"{fullname} holds the kit's own version of an exercise: it cannot be loaded again "
                              "while your code is being checked")
        if fullname.startswith("hpdl.checker.cases") or fullname.startswith("hpdl_cases_") \
                or (package == "hpdl.checker" and short_name in DECIDING_SIDE):
            raise ImportError(f"{fullname} holds the checker's reference solutions: not importable while "
                              "your code is being checked")
        return None


class _Public(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the public cut of the case module (and of the sibling modules it imports) from source."""

    def __init__(self, sources: dict[str, str], files: dict[str, str]):
        self.sources, self.files = sources, files

    def find_spec(self, fullname, path, target=None):
        if fullname in self.sources:
            return importlib.util.spec_from_loader(fullname, self, origin=f"<public part of {fullname}>")
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__name__
        exec(compile(self.sources[name], self.files.get(name, f"<public part of {name}>"), "exec"), vars(module))


def load_public(public: dict) -> types.ModuleType:
    """The case module as this process may hold it: split.shake's cut of inputs() and call()."""
    finder = _Public(dict(public["sources"]), dict(public.get("files", {})))
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(public["module"])
    finally:
        sys.meta_path.remove(finder)


def refuse_kit_answers(answers: dict[str, str]) -> None:
    """Replace each of the kit's own implementations of an exercise with a function that refuses
    (recording.ForbiddenCall), holding no reference to the original: the learner's function,
    however it names them, gets the refusal, and the module cannot be loaded again from here."""
    from hpdl.checker.recording import ForbiddenCall

    for dotted, reason in answers.items():
        module_name, _, attr = dotted.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - a library not installed, or one that cannot load here
            continue

        def refuse(*args, _name=dotted, _reason=reason, **kwargs):
            from hpdl.checker.recording import recorder

            recorder.rejected.append(_name)  # rejected even if the learner catches the exception
            raise ForbiddenCall(_name, _reason)

        refuse.__name__ = refuse.__qualname__ = attr
        original = getattr(module, attr, None)
        # a library's class: reachable as itself too (a base's __subclasses__()), and through a subclass with
        # methods of its own (torch's ElasticDistributedSampler, its __iter__ DistributedSampler's: 12/12)
        for cls in _with_subclasses(original) if isinstance(original, type) else ():
            for method in ("__init__", "__new__", "__iter__", "__len__", "set_epoch"):
                if method in vars(cls):
                    setattr(cls, method, refuse)
        setattr(module, attr, refuse)
        _KIT_MODULES.add(module_name)


def _with_subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo and len(found) < 1000:
        c = todo.pop()
        if c not in found:
            found.append(c)
            todo.extend(c.__subclasses__())
    return found


def kit_code_carried(fn, answers) -> str:
    """Where the learner's function carries by value the code of one of the kit's `answers` (hooks.KIT_ANSWERS:
    'module.function'), its 'file: name'; else ''. Those are refused here (refuse_kit_answers) and their module
    files are stripped copies; a function built in the notebook from one's code object (types.FunctionType(
    kit.__code__, ...), its __module__ the learner's) was pickled by value and passed as the learner's own
    (24/24). Followed: the functions it reaches by its globals, closure and defaults, and the classes it defines.
    Only the answers' code counts: a closure a kit function made (a hook, say) is the learner's to use."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds the package hpdl
    kit = {(os.path.join(top, *dotted.split(".")[:-1]) + ".py", dotted.rsplit(".", 1)[1]) for dotted in answers}
    todo, seen = [fn], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen or len(seen) > 10_000:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            todo.extend(v for v in vars(obj).values() if isinstance(v, (types.FunctionType, type)))
            continue
        codes = [obj.__code__]
        while codes:
            code = codes.pop()
            if (os.path.abspath(code.co_filename), code.co_name) in kit:
                return f"{os.path.relpath(code.co_filename, top)}: {code.co_name}"
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            todo.extend(v for name in code.co_names
                        if isinstance(v := obj.__globals__.get(name), (types.FunctionType, type)))
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        todo.extend(v for v in [*cells, *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
                    if isinstance(v, (types.FunctionType, type)))
    return ""


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def strip_module(module: types.ModuleType) -> dict:
    """What this process keeps of a case module: inputs(), call() and what they reach.

    Everything else (reference, verify, diagnose, helpers only they use) is deleted from the
    module, and the module from sys.modules, so no path from the learner's code leads to it.
    """
    keep: set[str] = set()
    todo = [getattr(module, n) for n in KEEP if callable(getattr(module, n, None))]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):  # a class inputs() hands out: what its methods use stays too
            for v in vars(obj).values():
                v = getattr(v, "__func__", v)
                todo.extend([v.fget, v.fset, v.fdel] if isinstance(v, property) else [v])
            continue
        code = getattr(obj, "__code__", None)
        if code is None:
            continue
        codes = [code]
        while codes:
            c = codes.pop()
            for name in c.co_names:
                if name in vars(module) and name not in keep:
                    keep.add(name)
                    todo.append(vars(module)[name])
            codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    kept = {n: getattr(module, n) for n in KEEP if callable(getattr(module, n, None))}
    for name in list(vars(module)):
        if name.startswith("__") or name in keep or name in KEEP:
            continue
        value = vars(module)[name]
        if callable(value) or isinstance(value, types.ModuleType):
            delattr(module, name)
    for name, mod in list(sys.modules.items()):
        if mod is module or name.startswith("hpdl.checker.cases.") or name.startswith("hpdl_cases_"):
            del sys.modules[name]
    pkg = sys.modules.get("hpdl.checker.cases")
    if pkg is not None:
        pkg.LOCKED = True  # load()/load_file() refuse from now on
        for name in list(vars(pkg)):
            value = getattr(pkg, name)
            if isinstance(value, types.ModuleType) and value.__name__.startswith("hpdl.checker.cases."):
                delattr(pkg, name)
    sys.meta_path.insert(0, _NoAnswerKey())
    return kept


# said beside an error that a socket refused (confine.no_new_endpoints, the socket filter) may have caused
NO_SOCKETS = (" (in this check your ranks may open no socket of their own once your code runs: no new process group, "
              "server or listener; move the data with the communicator or process group you are given)")


class LearnerJob(RankJob):
    outer_pid: int | None = None  # this rank's PID as the sandbox sees it, once isolated

    def before_mpi(self, job_dir: str) -> None:
        """In a sandbox (spec["isolate"]): a view of its own (isolate.py), then the whole seccomp filter
        (the sandbox's own let the launcher and this step make namespaces). Before MPI, whose threads
        would forbid the first, and before any learner's code."""
        if not self.spec.get("isolate"):
            return
        from hpdl.checker import confine, isolate

        rank = isolate.rank_from_env()
        if rank is None:
            raise RuntimeError("this rank's launcher gave it no rank variable (PMI_RANK, OMPI_COMM_WORLD_RANK, "
                               "PMIX_RANK): it cannot be given a folder of its own")
        self.outer_pid = isolate.isolate(job_dir, rank)
        self.env_rank = rank
        confine.install(inet_only=True)  # sockets over IP only: what crosses between ranks, the meter counts

    def own_dir(self, job_dir: str) -> str:
        from hpdl.checker import isolate

        if self.outer_pid is not None and self.env_rank != self.rank:
            raise RuntimeError(f"MPI made this process rank {self.rank}, its launcher said {self.env_rank}")
        return isolate.rank_dir(job_dir, self.rank)

    def barrier(self, tag: str) -> None:
        """Wait until the checker has seen every rank reach `tag` (the ranks share no folder to meet in)."""
        self.emit(ev="at", tag=tag)
        self.wait_for(os.path.join(self.dir, f"go-{tag}"))

    def current_call(self) -> str | None:
        from hpdl.checker.recording import recorder

        return recorder.current

    def run(self) -> int:
        from hpdl.checker import recording, wire
        from hpdl.checker.cases import Case
        from hpdl.checker.hooks import KIT_ANSWERS

        spec = self.spec
        code = spec["code"]
        module = load_public(spec["public"])
        funcs = strip_module(module)
        recording.install({**KIT_ANSWERS, **(spec.get("forbidden") or {})}, sized=bool(spec.get("metered")),
                          synchronous=spec.get("send_waits", True))
        refuse_kit_answers({**KIT_ANSWERS, **{name: why for name, why in (spec.get("forbidden") or {}).items()
                                              if "." in name}})  # a library's, named by a case module
        self.private = self.take_private_inputs() if spec.get("private") else None
        if spec.get("metered") or funcs.get("set_up"):
            self.connect_every_rank(recording)
        set_up_sockets = self.set_up(funcs.get("set_up"), recording)
        calibrate = funcs.get("calibrate") if spec.get("metered") and spec.get("calibrate") else None
        # METERED (meter.py): a communicator per case made now, so their set-up traffic is not counted as
        # the learner's; then every rank waits until the checker has read the wire, before any learner's code
        self.comms = {index: self.world.Dup() for index, _ in spec["cases"]} if spec.get("metered") else {}
        # and one for each case's calibration: a first collective on a fresh communicator, as the learner's is
        fresh = {index: self.world.Dup() for index, _ in spec["cases"]} if calibrate is not None else {}
        self.emit(ev="ready", pid=self.outer_pid or os.getpid(), rank=self.rank, size=self.size,
                  isolated=self.outer_pid is not None, set_up_sockets=set_up_sockets)
        if spec.get("metered"):
            state["phase"] = "metering"
            self.barrier("ready")
            self.wait_for(os.path.join(self.dir, "metered-start"))
            for index, case_dict in spec["cases"] if calibrate is not None else ():
                with recording.paused():  # what one all-reduce of the case's size takes: read by the checker
                    calibrate(fresh.pop(index), Case(**case_dict))
                self.barrier(f"calibrated_{index}")
        if spec.get("oracle"):  # before the learner's code: the helper holds the secrets, this process never
            from hpdl.checker import oracle

            oracle.start(os.path.join(self.dir, f"oracle-{self.rank}.bin"), funcs["serve"])
            self.barrier("oracle")  # every rank's secrets file gone before any learner's code runs
        # as before the learner's code: wire.pack rebound there packed made-up calls; the lists emptied, forbade nothing
        installed = tuple(recording.INSTALLED.items())
        pack = functools.partial(_sealed, wire.pack, type(recording.recorder).intact, installed)
        fn, unpack_error = self.unpack(code)
        for index, case_dict in spec["cases"]:
            case = Case(**case_dict)
            state["case"], state["phase"] = index, "inputs"
            self.emit(ev="start", case=index)
            if fn is None:
                result = {"status": "error", "message": unpack_error}
            else:
                result = self.run_case(funcs, case, index, fn, recording, pack, installed)
            state["phase"] = "waiting"
            self.emit(ev="end", case=index, **result)
            self.barrier(str(index))
            if spec.get("metered"):  # the checker reads this case's bytes on the wire before the next starts
                state["phase"] = "metering"
                self.wait_for(os.path.join(self.dir, f"metered-{index}"))
        state["phase"] = "exiting"
        self.emit(ev="exit")
        return 0

    def unpack(self, code: dict):
        """The learner's function rebuilt here, and why it could not be ('' where it was). First, in an isolated
        metered rank (its sockets made, every rank connected), no bind() or listen() from now on: the ranks share
        a network namespace, and the addresses a socket takes there every rank can read."""
        if self.spec.get("metered") and self.outer_pid is not None:
            from hpdl.checker import confine

            confine.no_new_endpoints()
        try:
            from hpdl.checker.source import unpack

            fn = unpack(code)
        except BaseException as exc:  # e.g. the learner's globals could not be rebuilt here
            return None, (f"{short(f'{type(exc).__name__}: {exc}')} (your function could not be rebuilt on a fresh "
                          "rank: define what it uses in the notebook)")
        from hpdl.checker.hooks import KIT_ANSWERS

        carried = kit_code_carried(fn, KIT_ANSWERS)
        if carried:
            return None, (f"your function carries the kit's own code ({carried}), copied from its module in your "
                          "notebook: write the exercise yourself")
        return fn, ""

    def connect_every_rank(self, recording) -> None:
        """A message to and from every rank: an MPI that connects lazily (Open MPI) connects now, not within a
        case module's set_up() (counted as its) nor within a metered learner's code (which may bind no socket:
        confine.no_new_endpoints)."""
        with recording.paused():
            for k in range(1, self.size):
                self.world.sendrecv(None, (self.rank + k) % self.size, source=(self.rank - k) % self.size)

    def set_up(self, set_up, recording) -> list[int]:
        """The case module's set_up(), if any (torch.distributed's process group, say), before any learner's
        code and before the meter's first reading; the sockets it opened, which the meter counts apart."""
        if set_up is None:
            return []
        from hpdl.checker.meter import socket_inodes

        before = socket_inodes("self")
        with recording.paused():
            set_up()
        return sorted(socket_inodes("self") - before)

    def hold(self, index: int) -> None:
        """A case whose params carry "hold": before its learner's code runs here, this rank asks the checker
        to hold it still (stopped from outside) while the others run, and waits (hold.py, jobs.Job.hold)."""
        state["phase"] = "held"
        self.emit(ev="hold", case=index)
        self.wait_for(os.path.join(self.dir, f"go-hold_{index}"))

    def pause(self, index: int, tag: str) -> None:
        """cases.read_wire_here(tag) in case `index`: wait until the checker has read the wire (jobs.Job.pause:
        once every rank is here and the wire is still, or at once for this rank alone). The rank's other
        threads (torch.distributed's) go on meanwhile."""
        before, state["phase"] = state["phase"], "paused"
        self.emit(ev="pause", case=index, tag=tag)
        self.wait_for(os.path.join(self.dir, f"go-pause_{index}_{tag}"))
        state["phase"] = before

    def take_private_inputs(self) -> dict:
        """This rank's inputs to every case (PRIVATE_INPUTS), read and removed before the learner's
        code is unpacked on any rank. (Not hidden from the other ranks' memory: MPICH's shared-memory
        transport reads it (process_vm_readv), and ranks that share data by other means than
        messages share it anyway; the recorded messages are what tells.)"""
        from hpdl.checker import wire

        path = os.path.join(self.dir, f"in-{self.rank}.bin")
        with open(path, "rb") as f:
            data = wire.unpack(f.read())
        os.remove(path)
        self.barrier("inputs")
        return data

    def run_case(self, funcs: dict, case, index: int, fn, recording, pack, installed: tuple) -> dict:
        if self.private is not None:
            args = tuple(self.private.pop(index))
        else:
            args = tuple(funcs["inputs"](case, self.rank, self.size))
        comm = self.comms.pop(index, None) or self.world.Dup()
        if self.spec["code"].get("from_engines"):
            self.rebind(fn, comm)
        recorder = recording.recorder
        recorder.reset(dict(installed))  # what the last case's code did to it does not carry over
        metered, last = bool(self.spec.get("metered")), self.rank == self.size - 1
        if case.params.get("hold") is True and metered and last:
            self.hold(index)
        from hpdl.checker import cases as cases_pkg

        metered_pause = case.params.get("pause") in ("together", "alone") and metered
        cases_pkg._read_wire = (lambda tag: self.pause(index, tag)) if metered_pause else None
        hold_here = case.params.get("hold") == "here" and metered and self.size > 1
        cases_pkg._hold_here = (lambda: self.hold(index)) if hold_here and last else None
        cases_pkg._passed_here = ((lambda tag: self.emit(ev="passed", case=index, tag=tag))
                                  if hold_here and not last else None)
        state["phase"] = "learner"
        call, ready, t0 = funcs.get("call"), _when_ready(fn, recording), time.perf_counter()
        try:
            got = call(ready, comm, copy.deepcopy(args)) if call else ready(comm, *copy.deepcopy(args))
        except recording.ForbiddenCall as exc:
            return {"status": "forbidden", "message": str(exc), "name": exc.name,
                    "where": learner_where(traceback.extract_tb(exc.__traceback__), self.files)}
        except BaseException as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            why = NO_SOCKETS if self.spec.get("metered") and "not permitted" in str(exc) else ""
            return {"status": "error", "exception": type(exc).__name__,
                    "message": short(f"{type(exc).__name__}: {exc}") + why, "where": learner_where(frames, self.files),
                    "traceback": learner_traceback(exc.__traceback__, self.files),
                    "seconds": time.perf_counter() - t0}
        seconds = time.perf_counter() - t0
        state["phase"] = "packing"
        if recorder.rejected:  # raised ForbiddenCall, but the learner caught it
            name = recorder.rejected[0]
            shown = name if "." in name else f"comm.{name}"
            return {"status": "forbidden", "name": name,
                    "message": f"{shown}() is not allowed here: {recorder.forbidden.get(name, 'forbidden')}"}
        refused = self.unfinished(recorder.unfinished()) or self.overwritten(recorder.overwritten_at_return())
        if refused:
            return refused
        calls = [(c.name, c.dest, c.source, c.count, c.nbytes, c.head, c.exact) for c in recorder.calls]
        try:
            data = pack(recorder, got, calls)
        except Exception as exc:
            return {"status": "error", "exception": type(exc).__name__,
                    "message": short(f"what your function returned could not be sent back: {type(exc).__name__}: "
                                     f"{exc}")}
        out = os.path.join(self.dir, f"out-{index}-{self.rank}.bin")
        with open(out + ".tmp", "wb") as f:
            f.write(data)
        os.replace(out + ".tmp", out)
        return {"status": "ok", "seconds": seconds, "bytes": len(data)}

    def unfinished(self, unfinished: list) -> dict | None:
        """A rank that returned with requests still open: refused, whatever its results (recording.unfinished)."""
        if not unfinished:
            return None
        counts: dict[str, int] = {}
        for call, _ in unfinished:
            counts[call] = counts.get(call, 0) + 1
        listed = ", ".join(f"{call} ×{k}" if k > 1 else call for call, k in counts.items())
        file, line, name = unfinished[0][1]
        where = learner_where([traceback.FrameSummary(file, line, name)], self.files)
        return {"status": "forbidden", "name": "an unfinished request",
                "message": f"rank {self.rank} returned with {len(unfinished)} non-blocking "
                           f"call{'s' if len(unfinished) > 1 else ''} not finished "
                           f"({listed}): complete each request (req.Wait(), or MPI.Request.Waitall(requests); a "
                           "torch.distributed work: work.wait()) before its buffer is used again and before the "
                           "function returns. Until then MPI or torch.distributed may still be reading the send "
                           "buffer or filling the receive one: small messages are copied at once, so the results "
                           "can look right; large ones are not", "where": where}

    def overwritten(self, overwritten: list) -> dict | None:
        """A rank that changed a send's buffer before the send completed (recording._Recorder.settle)."""
        if not overwritten:
            return None
        call, (file, line, name) = overwritten[0]
        where = learner_where([traceback.FrameSummary(file, line, name)], self.files)
        more = f" (and {len(overwritten) - 1} more)" if len(overwritten) > 1 else ""
        return {"status": "forbidden", "name": "a send buffer changed in flight",
                "message": f"rank {self.rank} changed the buffer of {call}{more} before its request completed: MPI "
                           "may read a send buffer at any time until then, so the receiver can get the new values "
                           "instead. Here small messages are copied at once and the results can look right; keep "
                           "one buffer per message in flight, or wait for the send before reusing its buffer",
                "where": where}

    def rebind(self, fn, comm) -> None:
        """A function written under %%px may use the engines' own names (rank, world_size,
        comm); here they must mean this rank's, not rank 0's values pickled with it."""
        names = {"rank": self.rank, "world_size": self.size, "local_rank": self.rank, "comm": comm}
        g = getattr(fn, "__globals__", {})
        for name, value in names.items():
            if name in g:
                g[name] = value


def _sealed(pack, intact, installed: tuple, recorder, got, calls: list) -> bytes:
    """What one case sends back: the answer, the recorded calls, and whether the record was altered."""
    return pack({"got": got, "calls": calls, "altered": not intact(recorder, installed),
                 "waits": [list(w) for w in recorder.waits[:MAX_WAITS]]})


def _when_ready(fn, recording):
    """The learner's function, with the recorder made ready each time it is called (recording.ready_for_learner):
    a case module's call() may import torch first."""
    @functools.wraps(fn)
    def learners(*args, **kwargs):
        recording.ready_for_learner()
        return fn(*args, **kwargs)

    return learners


if __name__ == "__main__":
    sys.exit(main(LearnerJob, sys.argv[1:]))
