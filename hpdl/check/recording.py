"""Rank side: the communicator handed to the learner, recording every MPI call it makes.

RecordingComm is an mpi4py Intracomm whose methods note the call (name and peer rank) in
`recorder` before doing it, and raise ForbiddenCall for the names the exercise forbids.
`recorder.current` names the call in progress, so a hang report can say "inside comm.Recv()
from rank 3". Communicators made from it (Dup, Split, ...) record too. Imported only inside
check workers: importing mpi4py.MPI starts MPI.
"""
from __future__ import annotations

from mpi4py import MPI

from hpdl.check.cases import Call
from hpdl.check.hooks import COLLECTIVES


class ForbiddenCall(BaseException):
    """Raised inside the learner's code when it calls an MPI function the exercise forbids.

    A BaseException, so a learner's `except Exception` does not swallow it.
    """

    def __init__(self, name: str, reason: str):
        super().__init__(f"comm.{name}() is not allowed here: {reason}")
        self.name, self.reason = name, reason


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.forbidden: dict[str, str] = {}
        self.rejected: list[str] = []
        self.current: str | None = None  # the MPI call the learner is inside, for hang reports

    def reset(self, forbidden: dict[str, str] | None = None) -> None:
        self.calls, self.rejected, self.current = [], [], None
        self.forbidden = dict(forbidden or {})


recorder = _Recorder()

# (position of dest, position of source) in each method's arguments after self
_P2P = {
    "Send": (1, None), "Ssend": (1, None), "Bsend": (1, None), "Rsend": (1, None),
    "Isend": (1, None), "Issend": (1, None), "Ibsend": (1, None), "Irsend": (1, None),
    "Send_init": (1, None), "Ssend_init": (1, None),
    "send": (1, None), "ssend": (1, None), "bsend": (1, None), "isend": (1, None), "issend": (1, None),
    "Recv": (None, 1), "Irecv": (None, 1), "Recv_init": (None, 1), "recv": (None, 1), "irecv": (None, 1),
    "Probe": (None, 0), "Iprobe": (None, 0), "Mprobe": (None, 0), "Improbe": (None, 0),
    "probe": (None, 0), "iprobe": (None, 0), "mprobe": (None, 0), "improbe": (None, 0),
    "Sendrecv": (1, 4), "sendrecv": (1, 4), "Sendrecv_replace": (1, 3),
    "Isendrecv": (1, 4), "Isendrecv_replace": (1, 3),
}
_MAKES_COMM = ("Dup", "Clone", "Split", "Split_type", "Create", "Create_group", "Idup", "Dup_with_info")


def _peer(args, kwargs, pos, key):
    if key in kwargs:
        value = kwargs[key]
    elif pos is not None and len(args) > pos:
        value = args[pos]
    else:
        return None
    return value if isinstance(value, int) and value >= 0 else None


def _wrap(name: str):
    base = getattr(MPI.Intracomm, name)
    dpos, spos = _P2P.get(name, (None, None))

    def method(self, *args, **kwargs):
        if name in recorder.forbidden:
            recorder.rejected.append(name)
            raise ForbiddenCall(name, recorder.forbidden[name])
        call = Call(name, _peer(args, kwargs, dpos, "dest"), _peer(args, kwargs, spos, "source"))
        recorder.calls.append(call)
        peer = f" to rank {call.dest}" if call.dest is not None else ""
        peer += f" from rank {call.source}" if call.source is not None else ""
        recorder.current = f"comm.{name}(){peer}"
        try:
            return base(self, *args, **kwargs)
        finally:
            recorder.current = None

    method.__name__ = name
    method.__qualname__ = f"RecordingComm.{name}"
    return method


def _wrap_maker(name: str):
    base = getattr(MPI.Intracomm, name)

    def method(self, *args, **kwargs):
        new = base(self, *args, **kwargs)
        return RecordingComm(new) if isinstance(new, MPI.Intracomm) and not isinstance(new, RecordingComm) else new

    method.__name__ = name
    return method


class RecordingComm(MPI.Intracomm):
    """An mpi4py Intracomm that records the learner's MPI calls; communicators made from it
    (Dup, Split, ...) record too."""


for _name in [*_P2P, *COLLECTIVES]:
    if hasattr(MPI.Intracomm, _name):
        setattr(RecordingComm, _name, _wrap(_name))
for _name in _MAKES_COMM:
    if hasattr(MPI.Intracomm, _name):
        setattr(RecordingComm, _name, _wrap_maker(_name))
