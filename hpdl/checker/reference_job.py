"""Checker's ranks: the expected answers and the verdicts, out of the learner's reach.

    mpiexec -n P python -m hpdl.checker.reference_job JOB_DIR

Runs beside the learner's job (learner_job.py), never with the learner's code in it. Per case
each rank builds the same inputs, runs the case module's reference() on a communicator of
its own, then waits for the client (jobs.py) to hand over what the learner's rank returned:
JOB_DIR/go-<case>.json says whether to verify, and JOB_DIR/got-<case>-<rank>.bin holds the
learner's outputs and recorded calls, read back as plain data (wire.py). verify() and
diagnose() then run here, with ctx.comm a communicator between this job's ranks, so the
hooks that compare across ranks work as they always did. Verdicts go to rank<R>.jsonl.

A kit without keys (`hpdl keys strip`) holds no reference(): the expected answers of its public
cases were computed when it was stripped (expected.py) and are read from that data instead. With
spec["expected_only"] (expected.py, when stripping) the job writes each rank's expected answer to
JOB_DIR/expected-<case>-<rank>.bin and verifies nothing.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time

from hpdl.checker.rank_job import RankJob, main, short, state


class ReferenceJob(RankJob):
    def run(self) -> int:
        from hpdl.checker import expected as stored
        from hpdl.checker.cases import Case, is_public_only, load_file, with_nonce

        module = load_file(self.spec["module_path"])
        answers = stored.load(module) if is_public_only(module) else None
        self.emit(ev="ready", pid=os.getpid(), rank=self.rank, size=self.size)
        for index, case_dict in self.spec["cases"]:
            case = with_nonce(Case(**case_dict), self.spec.get("nonce"))
            state["case"], state["phase"] = index, "reference"
            self.emit(ev="start", case=index)
            args = tuple(module.inputs(case, self.rank, self.size))
            if answers is None:
                expected, ref_s = self.reference(module, args)
            else:
                expected, ref_s = stored.lookup(answers, case, self.rank)
            self.emit(ev="expected", case=index, reference_seconds=ref_s)
            if self.spec.get("expected_only"):
                stored.write(self.dir, index, self.rank, expected, ref_s)
                self.emit(ev="end", case=index, status="ok")
                self.barrier(str(index))
                continue
            state["phase"] = "waiting for the learner"
            go_path = os.path.join(self.dir, f"go-{index}.json")
            self.wait_for(go_path)
            with open(go_path) as f:
                go = json.load(f)
            state["phase"] = "verify"
            if go.get("verify"):
                result = self.verify(module, case, index, args, expected, go, ref_s)
            else:
                result = {"status": "skipped"}
            self.emit(ev="end", case=index, **result)
            self.barrier(str(index))
        state["phase"] = "exiting"
        self.emit(ev="exit")
        return 0

    def reference(self, module, args) -> tuple:
        ref_comm = self.world.Dup()
        t0 = time.perf_counter()
        expected = module.reference(ref_comm, *copy.deepcopy(args))
        ref_s = time.perf_counter() - t0
        ref_comm.Free()
        return expected, ref_s

    def verify(self, module, case, index: int, args, expected, go: dict, ref_s: float) -> dict:
        from hpdl.checker import hooks, wire
        from hpdl.checker.cases import Call, Context, Wrong

        problem = None
        try:
            path = os.path.join(self.dir, f"got-{index}-{self.rank}.bin")
            with open(path, "rb") as f:
                raw = f.read()
            os.unlink(path)  # read once: the checker's disk holds one case's outputs at a time, not a check's
            data = wire.unpack(raw)
            got, altered = data["got"], bool(data.get("altered"))
            calls = [_call(Call, c) for c in data["calls"]]
        except (OSError, KeyError, TypeError, ValueError, wire.NotPlainData) as exc:
            problem = f"what your function returned could not be read back: {short(exc, 200)}"
        # every rank learns whether every rank could read its outputs, before any collective in verify()
        unreadable = self.world.allgather(problem is not None)
        if problem is not None:
            return {"status": "wrong", "message": problem, "reference_seconds": ref_s}
        if any(unreadable):
            return {"status": "unverified", "reference_seconds": ref_s}
        learner_s = float(go.get("seconds", {}).get(str(self.rank), 0.0) or 0.0)
        wire = go["wire"].get(str(self.rank)) if isinstance(go.get("wire"), dict) else None
        ctx = Context(case, self.rank, self.size, args, got, expected, calls, self.world, learner_s, ref_s, wire)
        ctx.waits = _waits(data.get("waits"), len(calls))
        try:
            verify = getattr(module, "verify", None)
            wrong = (hooks.unseen_connections(ctx) if wire and wire.get("unseen")  # job-wide: no rank verifies
                     else Wrong(ALTERED, forged=True) if altered
                     else verify(case, ctx) if verify else hooks.compare(got, expected))
        except Exception as exc:
            wrong = Wrong(f"the result could not be checked: {short(f'{type(exc).__name__}: {exc}')}")
        result = {"reference_seconds": ref_s}
        if wrong is None:
            result["status"] = "ok"
            return result
        if not isinstance(wrong, Wrong):
            wrong = Wrong(str(wrong))
        hint = wrong.hint
        forged = bool(getattr(wrong, "forged", False))  # right values that came some other way: no hint about them
        if hint is None and not forged and hasattr(module, "diagnose"):
            try:
                hint = module.diagnose(case, ctx)
            except Exception:
                hint = None
        result.update(status="wrong", message=wrong.message, hint=hint, max_error=wrong.max_error, forged=forged,
                      telling=bool(getattr(wrong, "telling", False)))
        return result


ALTERED = ("the record of your MPI calls, kept in your process, was changed by code other than the checker's (a "
           "call removed, added or rewritten, or the recording paused by hand)")


def _waits(raw, calls: int) -> list[tuple[int, int]]:
    """The learner's completed requests, validated: (calls noted before the completion, the index of the
    Isend's or Irecv's call); anything else is left out (rendezvous.py then treats that request leniently)."""
    ok = lambda x: isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= calls  # noqa: E731
    return [(int(w[0]), int(w[1])) for w in (raw if isinstance(raw, list) else [])
            if isinstance(w, (list, tuple)) and len(w) == 2 and ok(w[0]) and ok(w[1]) and w[1] < w[0]]


def _call(Call, raw):
    """One recorded call from the learner's rank, validated: a name, integer peers and sizes."""
    name, dest, source, count, nbytes, head, exact = (list(raw) + [None, None, None])[:7]

    def num(x):
        return x if isinstance(x, int) and not isinstance(x, bool) else None

    if isinstance(head, str):  # bytes sent, as hex (recording.RAW of them)
        head = head if len(head) <= 256 and len(head) % 2 == 0 and all(c in _HEX for c in head) else None
    elif not (isinstance(head, (list, tuple)) and len(head) <= 64 and all(type(v) is float for v in head)):
        head = None
    head = (head if isinstance(head, str) else tuple(head)) if head else None
    return Call(str(name)[:80], num(dest), num(source), num(count), num(nbytes), head, num(exact))


_HEX = frozenset("0123456789abcdef")


if __name__ == "__main__":
    sys.exit(main(ReferenceJob, sys.argv[1:]))
