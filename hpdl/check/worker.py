"""Rank side: run a learner's function on the cases of one rank count, one rank per process.

    mpiexec -n P python -m hpdl.check.worker JOB_DIR

JOB_DIR/spec.pkl (written by runner.py) holds the learner's packed function, the case module's
path and the cases. For every case each rank writes a line to JOB_DIR/rank<R>.jsonl when it
starts and when it ends (ok, wrong, error or forbidden, with the learner's line where it
raised). Between cases the ranks wait for each other through files, sleeping rather than
spinning in MPI, so finished ranks leave the cores to the ones still working.

A daemon thread answers the client's stack requests (JOB_DIR/dump-request) with the main
thread's stack, read through sys._current_frames() while the main thread sits inside an MPI
call (mpi4py releases the GIL there), and ends the process if the client is gone or the job's
deadline passed, so a killed notebook never leaves ranks behind. faulthandler on SIGUSR1 is
the fallback for code that holds the GIL.
"""
from __future__ import annotations

import copy
import faulthandler
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback

_state = {"case": None, "phase": "starting"}


_offset = {"lines": 0}  # a %%px cell's body starts on the cell's line 2


def _learner_where(frames, files: set[str]) -> dict | None:
    ours = [f for f in frames if f.filename in files]
    if not ours:
        return None
    f = ours[-1]
    return {"file": f.filename, "line": f.lineno + _offset["lines"], "func": f.name, "code": (f.line or "").strip()}


def _learner_traceback(tb, files: set[str]) -> list[str]:
    frames = [f for f in traceback.extract_tb(tb) if f.filename in files]
    return [f"line {f.lineno + _offset['lines']} in {f.name}: {(f.line or '').strip()}" for f in frames]


class Worker:
    def __init__(self, job_dir: str):
        self.dir = job_dir
        with open(os.path.join(job_dir, "spec.pkl"), "rb") as f:
            self.spec = pickle.load(f)
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.files: set[str] = set()
        self.log = open(os.path.join(job_dir, f"rank{self.rank}.jsonl"), "a", buffering=1)
        self._fault = open(os.path.join(job_dir, f"rank{self.rank}.fault"), "w")
        faulthandler.register(signal.SIGUSR1, file=self._fault, all_threads=True, chain=False)
        threading.Thread(target=self._watch, args=(threading.main_thread().ident,), daemon=True,
                         name="hpdl-check-watch").start()

    def emit(self, **event) -> None:
        event["t"] = time.time()
        self.log.write(json.dumps(event, default=str) + "\n")
        self.log.flush()

    # -- the side thread: stack dumps, and never outliving the client ------------------------
    def _watch(self, main_ident: int) -> None:
        from hpdl.check.recording import recorder

        request = os.path.join(self.dir, "dump-request")
        client = int(self.spec["client_pid"])
        deadline = float(self.spec["deadline"])
        seen, tick = None, 0
        while True:
            time.sleep(0.05)
            tick += 1
            if tick % 10 == 0 and (time.time() > deadline or not _alive(client)):
                _unlink_shared_memory(client)  # MPI_Finalize, which would, never comes
                if self.rank == 0:  # nobody else will clean up the check's folder now
                    import shutil

                    shutil.rmtree(os.path.dirname(os.path.abspath(self.dir)), ignore_errors=True)
                os._exit(70)
            try:
                with open(request) as f:
                    token = f.read().strip()
            except OSError:
                continue
            if not token or token == seen:
                continue
            seen = token
            try:
                frame = sys._current_frames().get(main_ident)
                frames = traceback.extract_stack(frame) if frame is not None else []
                data = {
                    "token": token,
                    "rank": self.rank,
                    "case": _state["case"],
                    "phase": _state["phase"],
                    "where": _learner_where(frames, self.files),
                    "call": recorder.current,
                    "stack": [f"{f.filename}:{f.lineno} {f.name}" for f in frames[-8:]],
                }
                out = os.path.join(self.dir, f"stack{self.rank}.json")
                with open(out + ".tmp", "w") as f:
                    json.dump(data, f)
                os.replace(out + ".tmp", out)
            except Exception:  # the watcher must never take the rank down
                pass

    # -- the cases ----------------------------------------------------------------------------
    def run(self) -> int:
        from hpdl.check import hooks, recording
        from hpdl.check.cases import Case, load_file
        from hpdl.check.source import unpack

        spec = self.spec
        code = spec["code"]
        self.files = set(code.get("lines", {})) | {code["filename"]}
        _offset["lines"] = int(code.get("line_offset", 0))
        module = load_file(spec["module_path"])
        try:
            fn = unpack(code)
        except BaseException as exc:  # e.g. the learner's globals could not be rebuilt here
            fn, unpack_error = None, f"{type(exc).__name__}: {exc}"
        self.emit(ev="ready", pid=os.getpid(), rank=self.rank, size=self.size)
        for index, case_dict in spec["cases"]:
            case = Case(**case_dict)
            _state["case"], _state["phase"] = index, "inputs"
            self.emit(ev="start", case=index)
            if fn is None:
                result = {"status": "error", "message": f"{unpack_error} (your function could not be rebuilt on a "
                                                        "fresh rank: define what it uses in the notebook)"}
            else:
                result = self.run_case(module, case, fn, hooks, recording)
            _state["phase"] = "waiting"
            self.emit(ev="end", case=index, **result)
            self.barrier(index)
        _state["phase"] = "exiting"
        self.emit(ev="exit")
        return 0

    def run_case(self, module, case, fn, hooks, recording) -> dict:
        from hpdl.check.cases import Context

        args = tuple(module.inputs(case, self.rank, self.size))
        _state["phase"] = "reference"
        ref_comm = self.world.Dup()
        t0 = time.perf_counter()
        expected = module.reference(ref_comm, *copy.deepcopy(args))
        ref_s = time.perf_counter() - t0
        ref_comm.Free()

        learner_comm = recording.RecordingComm(self.world.Dup())
        if self.spec["code"].get("from_engines"):
            self.rebind(fn, learner_comm)
        recorder = recording.recorder
        recorder.reset(spec_forbidden(self.spec))
        _state["phase"] = "learner"
        t0 = time.perf_counter()
        try:
            call = getattr(module, "call", None)
            got = (call(fn, learner_comm, copy.deepcopy(args)) if call
                   else fn(learner_comm, *copy.deepcopy(args)))
        except recording.ForbiddenCall as exc:
            return {"status": "forbidden", "message": str(exc), "name": exc.name,
                    "where": _learner_where(traceback.extract_tb(exc.__traceback__), self.files)}
        except BaseException as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            return {
                "status": "error",
                "exception": type(exc).__name__,
                "message": _short(f"{type(exc).__name__}: {exc}"),
                "where": _learner_where(frames, self.files),
                "traceback": _learner_traceback(exc.__traceback__, self.files),
                "seconds": time.perf_counter() - t0,
            }
        learner_s = time.perf_counter() - t0
        if recorder.rejected:  # raised ForbiddenCall, but the learner caught it
            name = recorder.rejected[0]
            return {"status": "forbidden", "name": name,
                    "message": f"comm.{name}() is not allowed here: {recorder.forbidden[name]}"}

        _state["phase"] = "verify"
        ctx = Context(case, self.rank, self.size, args, got, expected, list(recorder.calls),
                      self.world, learner_s, ref_s)
        try:
            verify = getattr(module, "verify", None)
            wrong = verify(case, ctx) if verify else hooks.compare(got, expected)
        except Exception as exc:
            from hpdl.check.cases import Wrong

            wrong = Wrong(f"the result could not be checked: {_short(f'{type(exc).__name__}: {exc}')}")
        result = {"seconds": learner_s, "reference_seconds": ref_s}
        if wrong is None:
            result["status"] = "ok"
            return result
        hint = wrong.hint
        if hint is None and hasattr(module, "diagnose"):
            try:
                hint = module.diagnose(case, ctx)
            except Exception:
                hint = None
        result.update(status="wrong", message=wrong.message, hint=hint, max_error=wrong.max_error)
        return result

    def rebind(self, fn, comm) -> None:
        """A function written under %%px may use the engines' own names (rank, world_size,
        comm); here they must mean this rank's, not rank 0's values pickled with it."""
        names = {"rank": self.rank, "world_size": self.size, "local_rank": self.rank, "comm": comm}
        g = getattr(fn, "__globals__", {})
        for name, value in names.items():
            if name in g:
                g[name] = value

    def barrier(self, index: int) -> None:
        """Wait for every rank to finish case `index`, sleeping, not spinning in MPI."""
        open(os.path.join(self.dir, f"done-{index}-{self.rank}"), "w").close()
        names = [os.path.join(self.dir, f"done-{index}-{r}") for r in range(self.size)]
        pause = 0.0005
        while not all(os.path.exists(n) for n in names):
            time.sleep(pause)
            pause = min(pause * 1.5, 0.02)


def spec_forbidden(spec: dict) -> dict:
    return spec.get("forbidden") or {}


def _short(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _unlink_shared_memory(client: int) -> None:
    """Remove the /dev/shm segments this process maps (MPI's shared-memory transport), and the
    one of a client that started MPI itself and is gone (a killed kernel that imported mpi4py.MPI)."""
    from hpdl.reaper import _alive, shared_memory_of, singleton_shared_memory

    gone = set() if _alive(client) else singleton_shared_memory(client)
    for path in shared_memory_of([os.getpid()]) | gone:
        try:
            os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    worker = Worker(argv[0])
    try:
        return worker.run()
    except BaseException as exc:  # our own failure: say so on every rank, then leave
        worker.emit(ev="crash", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
