"""Learner's ranks: record every MPI and torch.distributed call, refuse the forbidden ones.

Installed once per learner process (`install`), before the learner's function is unpacked,
and at the level of the classes, not of one communicator object: every communicator the
learner can reach (the one handed in, MPI.COMM_WORLD, one made by Dup/Split/Create, a class
call such as `MPI.Comm.Allreduce(comm, ...)`) goes through the same methods, so each call is
noted in `recorder` (name, peer ranks whatever their integer type, message size) and a
forbidden one raises ForbiddenCall. One-sided MPI (windows) counts as a collective route
when reductions are forbidden, and torch.distributed's collectives are recorded (and refused
under the same rule) from the moment torch.distributed is imported, however the learner
imports them (`from torch.distributed import all_reduce` included).

This is evidence collected inside the learner's process: it stops every ordinary route, and
the verdict is decided elsewhere on what it recorded. Kit code that needs MPI itself in this
process (the torch.distributed rendezvous) runs under `paused()`.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import importlib.abc
import numbers
import operator
import os
import struct
import sys
import threading
import types
from typing import Any

from hpdl.checker.cases import Call
from hpdl.checker.hooks import BLOCKING_RECEIVES, COLLECTIVES, COMMUNICATOR_MAKERS, SYNCHRONOUS

_KIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ForbiddenCall(BaseException):
    """Raised inside the learner's code when it calls something the exercise forbids.

    A BaseException, so a learner's `except Exception` does not swallow it.
    """

    def __init__(self, name: str, reason: str):
        shown = name if "." in name else f"comm.{name}"
        super().__init__(f"{shown}() is not allowed here: {reason}")
        self.name, self.reason = name, reason


def _tally():
    """What the recorder's own code noted, kept apart from the recorder's attributes: a digest of the calls it
    appended and the depth of the pauses the kit's code made, per thread. Code that rewrites the recorder
    (recorder.calls replaced, a call removed or made up and appended, recorder._paused set by hand) leaves
    the two apart, and the case's calls go out marked as altered (no case of the check counts then). This is
    evidence in the learner's process too: it stops the ordinary rewrites; the wire decides the rest."""
    state = {"digest": hash(()), "altered": False}
    depth, lock = threading.local(), threading.Lock()

    def add(calls: list, call) -> None:
        with lock:  # calls from two threads land in the list in the order the digest takes them
            calls.append(call)
            state["digest"] = hash((state["digest"], tuple(call.__dict__.values())))

    def withdraw(calls: list, call) -> None:
        with lock:  # the call's own entry (the last of it), and the digest of the calls left
            at = next((i for i in range(len(calls) - 1, -1, -1) if calls[i] is call), None)
            if at is None:
                return
            before = intact(calls)
            del calls[at]
            if before:
                state["digest"] = digest_of(calls)

    def clear() -> None:
        state["digest"], state["altered"] = hash(()), False

    def pause(step: int) -> None:
        depth.n = getattr(depth, "n", 0) + step

    def paused(claimed: int) -> bool:
        if claimed != getattr(depth, "n", 0):
            state["altered"] = True
        return getattr(depth, "n", 0) > 0

    def digest_of(calls: list) -> int:
        digest = hash(())
        for call in calls:
            digest = hash((digest, tuple(getattr(call, "__dict__", {"": call}).values())))
        return digest

    def intact(calls: list) -> bool:
        return not state["altered"] and digest_of(calls) == state["digest"]

    return add, withdraw, clear, pause, paused, intact


_add, _withdraw, _clear, _pause, _paused_by_kit, _intact = _tally()


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.forbidden: dict[str, str] = {}
        self.rejected: list[str] = []
        self.current: str | None = None  # the call the learner is inside, for hang reports
        self.installed = False
        self.sized = False  # note each send's bytes (METERED checks compare them with the wire)
        self.synchronous = True  # a blocking Send runs as Ssend (SYNCHRONOUS); not where a check reads buffering
        self.torch_hooked = False
        self.started: list[tuple[str, Any, Any]] = []  # (call, its request, the learner's line): non-blocking calls
        self.sending: list[tuple[Any, Any, int, str, Any]] = []  # a send in flight: request, buffer, checksum, ...
        self.overwritten: list[tuple[str, Any]] = []  # (call, line): a send whose buffer changed before it completed
        self.waited: dict[int, Any] = {}  # id of a torch.distributed work the learner waited on: None, or its future
        self.persistent: dict[int, dict] = {}  # a persistent request's handle: its call, label, send view, starts
        self.dests: dict[int, Any] = {}  # id of a send's request: the rank it sends to (world numbering)
        self.freed: list[tuple[Any, Any, int, str, Any]] = []  # a send freed in flight: dest, buffer, checksum, ...
        self.receiving: list[tuple[Any, Any]] = []  # a non-blocking receive in flight: its request, its source
        self.completed: set[int] = set()  # handles of requests completed, maybe through a copy of their object
        self.unsourced: dict[int, tuple] = {}  # a receive from any source in flight: its handle -> its call, noted
        #                                        once completed, from the source its status names (_sourced)
        self.requested: dict[int, int] = {}  # an Isend's or Irecv's open handle -> its call's index in calls (where
        #                                      sends are not synchronous: the replay, rendezvous.py, reads them)
        self.waits: list[tuple[int, int]] = []  # (calls noted before it, the call's index): a request completed
        self._paused = threading.local()

    def reset(self, forbidden: dict[str, str] | None = None) -> None:
        self.calls, self.rejected, self.current, self.started = [], [], None, []
        self.sending, self.overwritten, self.waited, self.persistent = [], [], {}, {}
        self.dests, self.freed, self.receiving, self.completed = {}, [], [], set()
        self.unsourced, self.requested, self.waits = {}, {}, []
        _clear()
        if forbidden is not None:
            self.forbidden = dict(forbidden)

    @property
    def paused_now(self) -> bool:
        """Whether the kit's code paused the recording on this thread (a pause set by hand is not one)."""
        return _paused_by_kit(getattr(self._paused, "depth", 0))

    def add(self, call: Call) -> None:
        _add(self.calls, call)

    def withdraw(self, call: Call | None) -> None:
        """A call MPI refused (it raised): it moved nothing, so it is no longer recorded (a send of a view mpi4py
        refused as not contiguous, the error caught, was a ring's message beside a hidden all-reduce: 27/27)."""
        if call is not None:
            _withdraw(self.calls, call)

    def unfinished(self) -> list[tuple[str, Any]]:
        """The non-blocking calls (Isend, Irecv, Iallreduce, ...) whose request is still open: neither waited
        on, tested to completion nor freed. With small messages MPI copies the data at once and the results
        can look right; with large ones it reads the send buffer or fills the receive one until the request
        completes (a pipeline that never waited on its Isends scored 18/18, and was wrong at 512 KB). A
        torch.distributed work (async_op=True) likewise, until waited on: an all-reduce read before its
        wait() gave averages that were off, and the hint blamed the division."""
        return [(call, where) for call, request, where in self.started if _still_open(request)]

    def settle(self) -> None:
        """Each send whose request has just completed: its buffer must hold what it held when the send began.
        MPI may read a send buffer at any time until then; over TCP or below the eager limit it copies at the
        call, so a buffer reused for the next message looks harmless here and corrupts messages elsewhere.
        Each non-blocking receive just completed tells that its source's message arrived (heard_from)."""
        if self.receiving:
            arrived = [source for request, source in self.receiving if not _mpi_open(request)]
            self.receiving = [(request, source) for request, source in self.receiving if _mpi_open(request)]
            for source in arrived:
                self.heard_from(source)
        if not self.sending:
            return
        still = []
        for entry in self.sending:
            request, view, checksum, call, where = entry
            if _mpi_open(request):
                still.append(entry)
            elif _checksum(view) != checksum:
                self.overwritten.append((call, where))
        self.sending = still

    def free_in_flight(self, request) -> None:
        """A send's request freed before it completed: MPI goes on reading its buffer, and nothing will say when
        it stops (Isend().Free() with the buffer refilled next step scored 27/27). Its buffer must hold until a
        message from the rank it went to arrives (an acknowledgement), or until the function returns."""
        for entry in self.sending:
            if (entry[0] is request or entry[0].handle == request.handle) and not request.Get_status():
                self.freed.append((self.dests.get(id(request)), *entry[1:]))

    def heard_from(self, source=None) -> None:
        """A message from `source` arrived (None or a wildcard: from anyone, or the function returned): the sends
        freed in flight to it are seen through, and their buffers compared."""
        keep = []
        for entry in self.freed:
            dest, view, checksum, call, where = entry
            if source is not None and source >= 0 and dest != source:
                keep.append(entry)
            elif _checksum(view) != checksum:
                self.overwritten.append((call, where))
        self.freed = keep

    def overwritten_at_return(self) -> list[tuple[str, Any]]:
        """The sends whose buffer changed in flight, once the sends that completed unwaited (a persistent one's
        start) and those freed in flight are compared too."""
        self.settle()
        self.heard_from(None)
        return self.overwritten

    def intact(self, installed: tuple = ()) -> bool:
        """Whether the calls and pauses are the recorder's own since reset() (see _tally), and the calls forbidden
        as `installed` (their items, as the learner job took them before any learner's code) are all still
        forbidden: a parameter server that emptied the recorder's list, then gathered and broadcast, scored 9/12."""
        kept = type(self.forbidden) is dict and all(self.forbidden.get(k) == v for k, v in installed)
        return _intact(self.calls) and kept

    def note(self, name: str, dest=None, source=None, count=None, kind: str = "mpi", nbytes=None,
             head=None, exact=None) -> Call | None:
        """Record one call, or refuse it (ForbiddenCall) when the exercise forbids it."""
        call = self.prepared(name, dest, source, count, kind, nbytes, head, exact)
        if call is not None:
            self.add(call)
        return call

    def prepared(self, name: str, dest=None, source=None, count=None, kind: str = "mpi", nbytes=None,
                 head=None, exact=None) -> Call | None:
        """The call as note() would record it, not recorded (a persistent request's: recorded at each start), or
        refused (ForbiddenCall) when the exercise forbids it."""
        if self.paused_now:
            return None
        key = name if kind == "mpi" else f"{kind}.{name}"
        reason = self.forbidden.get(key) or self.forbidden.get(name if kind == "mpi" else "")
        if reason:
            self.rejected.append(key)
            raise ForbiddenCall(key, reason)
        return Call(key, dest, source, count, nbytes, head, exact)


recorder = _Recorder()


def _kits_own(frame) -> bool:
    """Whether `frame` runs the kit's code in a kit module's globals: a file name alone is any code compiled under
    that name. (A case module's public part, served from source in a learner's job, has no file but its origin.)"""
    g, kit = frame.f_globals, _KIT + os.sep
    origin = g.get("__file__") or getattr(g.get("__spec__"), "origin", None) or ""
    return (str(g.get("__name__", "")).startswith("hpdl.") or g.get("__name__") == "__main__") \
        and os.path.abspath(frame.f_code.co_filename).startswith(kit) \
        and (os.path.abspath(str(origin)).startswith(kit) or str(origin).startswith("<public part of hpdl."))


@contextlib.contextmanager
def paused():
    """Kit code in the learner's process (never the learner's own) running MPI unrecorded."""
    if not _kits_own(sys._getframe(2)):
        raise ForbiddenCall("paused", "only the checker may pause the recording")
    recorder._paused.depth = getattr(recorder._paused, "depth", 0) + 1
    _pause(1)
    try:
        yield
    finally:
        recorder._paused.depth -= 1
        _pause(-1)


# -- MPI ---------------------------------------------------------------------------------------

# (position of dest, position of source) in each method's arguments after self
_P2P = {
    "Send": (1, None), "Ssend": (1, None), "Bsend": (1, None), "Rsend": (1, None),
    "Isend": (1, None), "Issend": (1, None), "Ibsend": (1, None), "Irsend": (1, None),
    "Send_init": (1, None), "Ssend_init": (1, None), "Bsend_init": (1, None), "Rsend_init": (1, None),
    "Psend_init": (2, None), "Precv_init": (None, 2),  # partitioned: (buf, partitions, dest or source, ...)
    "send": (1, None), "ssend": (1, None), "bsend": (1, None), "isend": (1, None), "issend": (1, None),
    "ibsend": (1, None),  # (unrecorded, a pickled message moved unseen by the record)
    "Recv": (None, 1), "Irecv": (None, 1), "Recv_init": (None, 1), "recv": (None, 1), "irecv": (None, 1),
    "Probe": (None, 0), "Iprobe": (None, 0), "Mprobe": (None, 0), "Improbe": (None, 0),
    "probe": (None, 0), "iprobe": (None, 0), "mprobe": (None, 0), "improbe": (None, 0),
    "Sendrecv": (1, 4), "sendrecv": (1, 4), "Sendrecv_replace": (1, 3),
    "Isendrecv": (1, 4), "Isendrecv_replace": (1, 3),
}
#: One-sided operations: a window lets ranks add into each other's memory without messages.
ONE_SIDED = ["Create", "Allocate", "Allocate_shared", "Create_dynamic"]


def _plain_peers(args: tuple, kwargs: dict, dpos, spos) -> tuple[tuple, dict]:
    """A call's dest and source as Python ints, read once through __index__, and handed to MPI so: mpi4py reads
    an object's __int__, the recorder its __index__, and a send recorded to a neighbour went to PROC_NULL or to
    the rank itself (27/27 beside a hidden all-reduce); nor does the learner's code run again inside the call."""
    args = list(args)
    for pos, key in ((dpos, "dest"), (spos, "source")):
        if key in kwargs:
            kwargs = {**kwargs, key: _plain_int(kwargs[key])}
        elif pos is not None and len(args) > pos:
            args[pos] = _plain_int(args[pos])
    return tuple(args), kwargs


def _plain_int(value):
    """A rank as a Python int where __index__ gives one; anything else as it is (MPI refuses it)."""
    if type(value) is int:
        return value
    try:
        return operator.index(value)
    except Exception:  # noqa: BLE001 - MPI refuses it, and the call is withdrawn
        return value


def _peer(args, kwargs, pos, key):
    if key in kwargs:
        value = kwargs[key]
    elif pos is not None and len(args) > pos:
        value = args[pos]
    else:
        return None
    try:
        value = operator.index(value)  # numpy integers too
    except TypeError:
        return None
    return value if value >= 0 else None


def _with_status(args: tuple, kwargs: dict, at: int) -> tuple[tuple, dict, Any]:
    """A blocking receive's arguments with a Status to read its source from: the learner's own where they
    passed one (at position `at`, or as status=), else a fresh one in its place."""
    from mpi4py import MPI

    given = kwargs.get("status") if "status" in kwargs else (args[at] if len(args) > at else None)
    if isinstance(given, MPI.Status):
        return args, kwargs, given
    status = MPI.Status()
    if len(args) > at:
        return (*args[:at], status, *args[at + 1:]), kwargs, status
    return args, {**kwargs, "status": status}, status


def _source_of(status) -> int | None:
    try:
        source = status.Get_source()
    except Exception:  # noqa: BLE001 - a status MPI never filled: from nobody known
        return None
    return source if isinstance(source, int) and source >= 0 else None


_COMM_BASE: dict[str, Any] = {}  # MPI's own Is_inter, Get_group, Get_size, Intercomm.Get_remote_group (_patch_mpi)


def _alone(comm) -> bool:
    """Whether `comm` holds this rank alone (COMM_SELF, a split of one) while the job has others, by MPI's own
    answers: a collective on it moves nothing to or from another rank, so it is recorded as carrying nothing.
    float64 Reduces of a shard each on COMM_SELF counted a shard's worth each (room for MPI's all-reduce called
    at its address: zero1_step 12/12)."""
    from mpi4py import MPI

    try:
        return (not _COMM_BASE["inter"](comm) and _COMM_BASE["size"](comm) == 1
                and _COMM_BASE["size"](MPI.COMM_WORLD) > 1)
    except Exception:  # noqa: BLE001 - not MPI's communicator: counted as it says
        return False


def _in_world(comm, dest, source):
    """Peers as ranks of MPI.COMM_WORLD (whose numbering the communicator handed in shares): a
    learner's own Split/Create/Cart communicator numbers ranks its own way, and the checks compare
    peers with neighbours in the world; an intercommunicator's, its remote group's."""
    if dest is None and source is None:
        return dest, source
    from mpi4py import MPI

    try:
        # MPI's own answers, not a method of the learner's subclass (an Is_inter() that said True left sends to
        # the rank itself recorded as sends to a neighbour); an intercommunicator's peers are its remote group's
        group = (_COMM_BASE["remote"] if _COMM_BASE["inter"](comm) else _COMM_BASE["group"])(comm)
        world = MPI.COMM_WORLD.Get_group()
        try:
            peers = [p for p in (dest, source) if p is not None]
            mapped = iter(MPI.Group.Translate_ranks(group, peers, world))
        finally:
            group.Free()
            world.Free()
    except Exception:  # an invalid communicator: MPI itself says so when the call goes on
        return dest, source
    return (None if dest is None else next(mapped)), (None if source is None else next(mapped))


def _count(buf, pickled: bool = False) -> int | None:
    """Elements in a send buffer: an array, [array, MPI type], or a Python object. `pickled` (mpi4py's
    lowercase calls, which send any object): every value the object holds, the arrays in a dict, list
    or tuple summed; a whole vector wrapped in a dict is still its n elements, not the dict's one key."""
    if pickled:
        return _elements(buf)
    count = _spec_count(buf, pairs=(tuple,))
    if count is not None:
        return count
    if isinstance(buf, (list, tuple)) and buf:
        buf = buf[0]
    size = getattr(buf, "size", None)
    if isinstance(size, int):
        return size
    try:
        return len(buf)
    except TypeError:
        return None


def _spec_count(buf, pairs: tuple = (tuple, list)) -> int | None:
    """The count a message spec names: [data, count], [data, (count, displ)], each with a type after it or
    not, [data, count, displ, type]; None where it names none ([data, type], or a vector collective's counts).
    [data, (count, displ)] with no type moved one chunk and was recorded as the whole buffer (0/27). `pairs`:
    what may hold (count, displ); a collective's is a tuple only (a list of two is two ranks' counts)."""
    if not isinstance(buf, (list, tuple)) or len(buf) < 2 or _spec_type(buf) is not None and len(buf) == 2:
        return None
    count = buf[1][0] if isinstance(buf[1], pairs) and len(buf[1]) == 2 else buf[1]
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _spec_type(buf):
    """The MPI datatype a message spec ends with, an MPI.Datatype or a typecode ('d', 'f', 'i': mpi4py takes
    both; a typecode was read as no type and the message as 0 bytes, 0/27); None where it names none."""
    if not isinstance(buf, (list, tuple)) or len(buf) < 2:
        return None
    from mpi4py import MPI

    last = buf[-1]
    if isinstance(last, str):
        try:
            return MPI.Datatype.fromcode(last)
        except Exception:
            return None
    return last if isinstance(last, MPI.Datatype) else None


def _elements(obj, depth: int = 0) -> int:
    """Values in a Python object: an array's or tensor's elements (a numpy array or scalar of raw bytes, text or
    records: its 32-bit words), a string's characters, a whole number's 32-bit words (a vector packed into one
    big int is its values: a naive ring sent so scored 27/27), the sum over a container's items (to a depth of
    8, its first 10**6 items), 1 for anything else; but beside an array or a tensor in a message (a tuple, list
    or dict), up to METADATA small whole numbers are its metadata (a chunk's index, a step, a shape), not
    values: (i, chunk) moves one chunk."""
    if depth == 0 and isinstance(obj, (list, tuple, dict)) and len(obj) <= 2 * METADATA:
        items = list(obj.values() if isinstance(obj, dict) else obj)
        small = sum(map(_is_metadata, items))
        if 0 < small <= METADATA and any(_is_array(v) for v in items):
            return sum(_elements(v, 1) for v in items if not _is_metadata(v))
    size = getattr(obj, "size", None) if _is_numpy(obj) else None  # not any object's own `size` (1 once)
    if isinstance(size, int):  # raw bytes, text or records (a void scalar of a whole gradient's bytes was 1 value)
        return max(size, -(-int(obj.nbytes) // 4)) if obj.dtype.kind in "VSU" else size
    if isinstance(obj, int) and not isinstance(obj, bool):  # a whole number of many bits holds many values
        return max(1, -(-obj.bit_length() // 32))
    if isinstance(obj, (str, bytes, bytearray, memoryview)):
        return len(obj)
    numel = getattr(obj, "numel", None)
    if callable(numel):
        try:
            return int(numel())
        except Exception:
            return 1
    if isinstance(obj, dict):
        obj = obj.values()
    if isinstance(obj, (list, tuple, set, frozenset, type({}.values()))) and depth < 8:
        return sum(_elements(v, depth + 1) for v in itertools.islice(obj, 10**6))
    carried = _pickled_parts(obj) if depth < 8 else None
    return max(1, _elements(carried, depth + 1)) if carried else 1


def _is_numpy(obj) -> bool:
    """A numpy array or scalar: whose `size` is its values (a SimpleNamespace(size=1, grad=...) said 1)."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, (numpy.ndarray, numpy.generic))


def _pickled_parts(obj) -> tuple | None:
    """What pickle takes of an object of any other class to send it: the arguments and state its __reduce_ex__
    gives (a SimpleNamespace's attributes, a class's __dict__ or __slots__, a partial's arguments). A chunk
    wrapped in a SimpleNamespace counted as 1 value, and an allgather of grad_x's parts beside y's columns
    passed for y's alone (15/15)."""
    if obj is None or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                                       bool, float, complex)):
        return None
    try:
        reduced = obj.__reduce_ex__(5)
    except Exception:  # noqa: BLE001 - not picklable: mpi4py fails on it too
        return None
    if not isinstance(reduced, tuple) or len(reduced) < 2:
        return None
    args = reduced[1] if isinstance(reduced[1], tuple) else ()
    parts = tuple(a for a in (*args, *reduced[2:3]) if a is not None and not isinstance(a, type))  # a class: its name
    return parts or None


METADATA = 4  # small whole numbers a message may carry beside its array uncounted (_elements): 32 bits each
# (a shape's dimension may pass 2**16: a vector of 100000 sent with its shape)


def _is_metadata(obj) -> bool:
    """A small whole number (bool and numpy's included): an index, a step, a shape's dimension; or a shape,
    a tuple of up to 4 of them."""
    if isinstance(obj, tuple) and 0 < len(obj) <= 4:
        return all(_is_metadata(v) for v in obj)
    return isinstance(obj, numbers.Integral) and abs(int(obj)) < 2**32


def _is_array(obj) -> bool:
    return isinstance(getattr(obj, "size", None), int) or callable(getattr(obj, "numel", None))


def _is_in_place(buf) -> bool:
    from mpi4py import MPI

    return buf is MPI.IN_PLACE or (isinstance(buf, (list, tuple)) and bool(buf) and buf[0] is MPI.IN_PLACE)


HEAD = 8  # values of a send noted as it starts (a METERED check's): what the message carried, not only how much
RAW = 64  # bytes of a message of bytes noted as it starts, as hex (hooks.readings reads them as values)


def _head(buf, pickled: bool = False) -> tuple | str | None:
    """The first HEAD values of an array or a CPU tensor sent whole (a buffer, or a pickled object), as floats;
    the first RAW bytes, as hex, of bytes (bytes, a bytearray, an array of bytes: a uint8 view); None for anything
    else. A parameter server that sent the average gradient, each worker stepping alone, moved as many values as
    the new parameters and scored 12/12. A pickled object's largest array among its first items and what pickle
    takes of it (the average in a SimpleNamespace, 12/12 again); a pickled list of numbers, its first ones. A
    message spec's part of its buffer, from its displacement. Messages of bytes went unread, and decoys sent as
    views of bytes hid an all-reduce called by address (hooks.passed_on); pickled text and big whole numbers are
    read by their bytes too."""
    try:
        return _head_of(buf, pickled)
    except Exception:  # noqa: BLE001 - the learner's send goes on, its first values unread
        return None


def _head_of(buf, pickled: bool) -> tuple | str | None:
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return _raw(buf)
    if pickled and not (callable(getattr(buf, "detach", None)) or hasattr(buf, "dtype")):
        if isinstance(buf, str):
            return _raw(buf[:RAW].encode("utf-8", "replace"))
        if isinstance(buf, int) and not isinstance(buf, bool) and abs(buf) >= 2**63:  # values packed in one int
            n = min(RAW, (abs(buf).bit_length() + 7) // 8)
            return _raw((abs(buf) & ((1 << 8 * n) - 1)).to_bytes(n, "little"))
        if _plain_number(buf):
            return (float(buf),)
        if isinstance(buf, (list, tuple)) and buf and all(_plain_number(v) for v in buf[:HEAD]):
            return tuple(float(v) for v in buf[:HEAD])
        inner = _largest_array(buf)
        return None if inner is None else _head(inner)
    if isinstance(buf, (list, tuple)):  # a message spec: [data, type], [data, count, type] start at data's start
        return _spec_head(buf)
    import numpy as np

    if callable(getattr(buf, "detach", None)):  # a tensor: its first values only to the CPU, not all of it
        first = buf.detach()
        first = (first.view(-1) if first.is_contiguous() else first.flatten())[:max(HEAD, RAW)]
        data = first.cpu().numpy()
    else:
        data = buf
    if not isinstance(data, np.ndarray):
        return None
    if data.dtype.itemsize == 1 or data.dtype.kind not in "fiu":
        return _raw(np.ascontiguousarray(data.flat[:max(1, RAW // max(1, data.dtype.itemsize))]))
    return tuple(float(v) for v in data.flat[:HEAD])  # .flat: no copy of the whole array


def _spec_head(buf) -> tuple | str | None:
    """A message spec's first values: [data, type], [data, count(, type)] from data's start; [data, (count,
    displ), type] and [data, count, displ, type] from the displacement, where the type is data's own item."""
    if not buf or isinstance(buf[0], (list, tuple)):
        return None
    count, displ = None, 0
    if len(buf) in (2, 3) and isinstance(buf[1], tuple) and len(buf[1]) == 2:
        count, displ = buf[1]
    elif len(buf) == 4:
        count, displ = buf[1], buf[2]
    elif len(buf) == 3:
        count = buf[1]
    elif len(buf) != 2 or isinstance(buf[1], list):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (count or 0, displ)):
        return None
    if displ:
        dtype = _spec_type(buf)  # none given: data's own
        if dtype is not None and dtype.Get_size() != _itemsize(buf[0]) or not hasattr(buf[0], "flat"):
            return None
        head = _head(buf[0].flat[displ:displ + max(HEAD, RAW)])
    else:
        head = _head(buf[0])
    return head[:count] if isinstance(head, tuple) and count is not None else head


def _raw(data) -> str | None:
    try:
        return bytes(memoryview(data).cast("B")[:RAW]).hex()
    except (TypeError, ValueError):
        return None


def _plain_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _largest_array(obj, depth: int = 0):
    """The array or tensor of most values in a pickled object: its items (the first 64 of each container),
    and the parts pickle takes of any other object (_pickled_parts), to a depth of 4."""
    if callable(getattr(obj, "detach", None)) or hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return obj
    if depth >= 4 or isinstance(obj, (str, bytes, bytearray, memoryview, numbers.Number)):
        return None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else _pickled_parts(obj)
    found = [a for a in (_largest_array(v, depth + 1) for v in itertools.islice(items or (), 64)) if a is not None]
    return max(found, key=lambda a: _elements(a), default=None)


def _nbytes(name: str, buf) -> int | None:
    """Bytes a send puts in its message: a buffer's, or the pickle mpi4py makes of an object."""
    if name[0].islower():
        import pickle

        try:
            return len(pickle.dumps(buf, pickle.HIGHEST_PROTOCOL))
        except Exception:
            return None
    try:
        count, dtype = _spec_count(buf), _spec_type(buf)
        if count is not None:  # [buf, count, type], [buf, (count, displ)], ...: count of the type, or of buf's items
            return count * (dtype.Get_size() if dtype is not None else _itemsize(buf[0]))
        if isinstance(buf, (list, tuple)) and buf:
            buf = buf[0]
        whole = memoryview(buf).nbytes
        extent = dtype.Get_extent()[1] if dtype is not None else 0
        # [data, type]: as many items of the type as data's bytes hold at its extent (mpi4py's count): a type
        # resized to the whole chunk moved one value and was recorded as the chunk, beside a hidden all-reduce
        return whole // extent * dtype.Get_size() if extent > 0 else whole
    except Exception:
        # no buffer: a torch tensor's bytes, by torch's own methods; no other object's nbytes (one of the learner's
        # said a chunk while MPI sent 0 by DLPack, beside a hidden all-reduce: 27/27)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(buf, torch.Tensor):
            return torch.Tensor.numel(buf) * torch.Tensor.element_size(buf)
        return None


#: a reduce-scatter is recorded twice: by its send buffer, and as "<name>:mine", by what this rank receives
#: of it; an all-gather in place, by this rank's part of the receive buffer (zero1_step holds a rank's share of
#: each against a shard)
_SCATTERS_TO_EACH = ("Reduce_scatter", "Ireduce_scatter", "Reduce_scatter_block", "Ireduce_scatter_block",
                     "Reduce_scatter_init", "Reduce_scatter_block_init")
_GATHERS_IN_PLACE = ("Allgather", "Allgatherv", "Iallgather", "Iallgatherv", "Allgather_init", "Allgatherv_init")


def _size(comm) -> int:
    try:
        return comm.Get_size()
    except Exception:
        return 1


# a buffer MPI may read until the request completes (Isendrecv_replace's is rewritten by design)
_SENDS_IN_FLIGHT = ("Isend", "Issend", "Ibsend", "Irsend", "Isendrecv")
# where each takes its status: from any source (MPI.ANY_SOURCE, mpi4py's default), the rank it came from is
# read from it once the message is in (pipeline stages telling directions apart by tag scored 0/18, every
# receive counted from nobody)
_STATUS_AT = {"Recv": 3, "recv": 3, "Sendrecv": 6, "sendrecv": 6, "Sendrecv_replace": 5}
_RECEIVES_IN_FLIGHT = ("Irecv", "irecv", "Isendrecv", "Isendrecv_replace")
_WILDCARD_RECEIVES = ("Irecv", "irecv")  # from any source, their source is read from their completion's status
_SEND_INITS = ("Send_init", "Ssend_init", "Bsend_init", "Rsend_init", "Psend_init")
_COMPLETIONS = ("Wait", "Test", "Free", "Waitall", "Testall", "Waitany", "Testany", "Waitsome", "Testsome",
                "wait", "test", "waitall", "testall", "waitany", "testany", "waitsome", "testsome")


def _send_view(buf):
    """The bytes a send reads: its array's (or a CPU tensor's), only the part a message spec names
    ([data, count], [data, (count, displ), type], [data, count, displ, type]); None where not a plain buffer
    or where a derived datatype picks the bytes (a chunk sent from x while another chunk of x is received)."""
    data, spec = (buf[0], list(buf[1:])) if isinstance(buf, (list, tuple)) and buf else (buf, [])
    whole = _bytes_of(data)
    if whole is None or not spec:
        return whole
    from mpi4py import MPI

    dtype = _spec_type(buf)
    if dtype is not None or isinstance(spec[-1], (str, MPI.Datatype)):
        spec.pop()
    if dtype is not None and not dtype.is_predefined:
        return None
    if len(spec) == 1 and isinstance(spec[0], (tuple, list)):
        spec = list(spec[0])
    if not spec or len(spec) > 2 or not all(isinstance(v, int) for v in spec):
        return whole if not spec else None
    count, displ = spec[0], spec[1] if len(spec) > 1 else 0
    extent = dtype.Get_extent()[1] if dtype is not None else _itemsize(data)
    return whole[displ * extent:(displ + count) * extent] if extent else None


def _bytes_of(data):
    try:
        return memoryview(data).cast("B")
    except (TypeError, ValueError):
        numpy = getattr(data, "numpy", None)
        try:
            return memoryview(numpy()).cast("B") if callable(numpy) else None
        except Exception:
            return None


def _itemsize(data) -> int:
    try:
        return memoryview(data).itemsize
    except (TypeError, ValueError):
        return int(getattr(data, "element_size", lambda: 0)())


def _checksum(view) -> int:
    import zlib

    return zlib.crc32(view)


def _settling(raw):
    """`raw`, a call that can complete requests, followed by settling the sends it completed. The handles it
    completed are noted: a request completed through a copy of its object (MPI.Request(r), another handle
    object for the same request) leaves the original holding its handle, and it was read as never finished."""
    def call(*args, **kwargs):
        before = _handles(args)
        restarted = _persistent_requested(args) if recorder.requested else []
        sourcing = [(request, handle) for request, handle in before
                    if handle in recorder.unsourced] if recorder.unsourced and not recorder.paused_now else []
        statuses: Any = None
        if sourcing:
            args, kwargs, statuses = _statuses_for(raw.__name__, args, kwargs)
        result: Any = None
        try:
            result = raw(*args, **kwargs)
            return result
        finally:
            if not recorder.paused_now:
                recorder.completed.update(handle for request, handle in before if not request)
                if recorder.requested and raw.__name__ not in ("Free", "free"):  # freed in flight: no wait
                    _note_waits([handle for request, handle in before if not request]
                                + [handle for _, handle in restarted if _all_completed(raw.__name__, result)])
                _sourced(sourcing, args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else
                         kwargs.get("requests"), statuses)
                recorder.settle()

    call._hpdl_recorded = True
    return call


def _note_waits(handles: list[int]) -> None:
    """The requests just completed, where their calls were noted for the replay (rendezvous.py)."""
    recorder.waits.extend((len(recorder.calls), recorder.requested.pop(handle)) for handle in handles
                          if handle in recorder.requested)


def _all_completed(name: str, result) -> bool:
    """Whether a completion call completed every request handed to it: a Wait or a Waitall that returned, a
    Test or a Testall that said so (a persistent request stays allocated, so this is how its completion shows;
    one a Waitany did not complete may have finished by itself, eagerly, and was never waited for)."""
    if name in ("Wait", "wait", "Waitall", "waitall"):
        return True
    flag = result[0] if isinstance(result, tuple) and result else result
    return name in ("Test", "test", "Testall", "testall") and flag is True


_STATUS_OF_ONE = {"Wait": 1, "Test": 1, "wait": 1, "test": 1}  # a request's own completion: its status at
_STATUS_OF_ANY = {"Waitany": 2, "Testany": 2, "waitany": 2, "testany": 2}  # one of the requests: one status
_STATUSES_OF_ALL = {"Waitall": 2, "Testall": 2, "waitall": 2, "testall": 2}  # a status per request, in order


def _statuses_for(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
    """A completion's arguments with somewhere for MPI to say where each message came from: the learner's own
    Status (or list of them) where they passed one, else a fresh one in its place. Waitsome and Testsome are
    left as they are (their receives from any source stay from nobody known)."""
    if name in _STATUS_OF_ONE or name in _STATUS_OF_ANY:
        return _with_status(args, kwargs, _STATUS_OF_ONE.get(name, _STATUS_OF_ANY.get(name)))
    if name in _STATUSES_OF_ALL:
        at = _STATUSES_OF_ALL[name]
        given = kwargs.get("statuses") if "statuses" in kwargs else (args[at] if len(args) > at else None)
        if isinstance(given, list):
            return args, kwargs, given
        fresh: list = []
        if len(args) > at:
            return (*args[:at], fresh, *args[at + 1:]), kwargs, fresh
        return args, {**kwargs, "statuses": fresh}, fresh
    return args, kwargs, None


def _sourced(sourcing: list, listed, statuses) -> None:
    """Each receive from any source that a completion just completed, noted with the rank its status names
    (a pipeline that tells directions apart by tag, waiting on Irecv(source=ANY_SOURCE), scored 0/18: every
    receive counted from nobody). `listed`: a Waitall's requests, in the order of its statuses."""
    from mpi4py import MPI

    for request, handle in sourcing:
        if request:  # not completed (a Test that found it still in flight)
            continue
        name, count, comm = recorder.unsourced.pop(handle)
        status = statuses
        if isinstance(statuses, list):
            at = next((i for i, r in enumerate(listed or ()) if r is request), None)
            status = statuses[at] if at is not None and at < len(statuses) else None
        source = _source_of(status) if isinstance(status, MPI.Status) else None
        recorder.note(name, *_in_world(comm, None, source), count)


def _handles(args) -> list[tuple[Any, int]]:
    """The MPI requests among a completion call's arguments (the request itself, or a list of them), each with
    its handle before the call."""
    from mpi4py import MPI

    found = []
    for arg in args[:2]:
        for request in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if isinstance(request, MPI.Request) and not isinstance(request, MPI.Prequest) and request:
                found.append((request, request.handle))
    return found


def _persistent_requested(args) -> list[tuple[Any, int]]:
    """The persistent requests among a completion call's arguments that were started with their start's call
    noted for the replay (recorder.requested): one stays allocated once complete, inactive until started again."""
    from mpi4py import MPI

    found = []
    for arg in args[:2]:
        for request in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if isinstance(request, MPI.Prequest) and request and request.handle in recorder.requested:
                found.append((request, request.handle))
    return found


def _freeing(raw):
    """`raw`, Request.Free: a send freed before it completed is held to its buffer still (free_in_flight)."""
    settling = _settling(raw)

    def call(self, *args, **kwargs):
        if not recorder.paused_now:
            recorder.free_in_flight(self)
        return settling(self, *args, **kwargs)

    call._hpdl_recorded = True
    return call


def _patch_requests() -> None:
    """After any call that can complete a request (Wait, Waitall, Test, ...), the sends it completed are
    settled (_Recorder.settle)."""
    from mpi4py import MPI

    d = _type_dict(MPI.Request)
    for name in _COMPLETIONS:
        raw = d.get(name)
        if raw is None or getattr(getattr(raw, "__func__", raw), "_hpdl_recorded", False):
            continue
        if isinstance(raw, classmethod):
            d[name] = classmethod(_settling(raw.__func__))
        else:
            d[name] = _freeing(raw) if name in ("Free", "free") else _settling(raw)
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(MPI.Request))


def _open_request(result) -> bool:
    """A request a learner must complete: not a persistent one (Send_init's stays allocated after Wait)."""
    from mpi4py import MPI

    return isinstance(result, MPI.Request) and not isinstance(result, MPI.Prequest) and bool(result)


def _still_open(request) -> bool:
    """An MPI request not yet completed, or a torch.distributed work neither waited on nor with its future done
    (a future can be done a moment before its work says it is completed)."""
    if type(request) not in _MARKED_WORKS:
        return _mpi_open(request)
    if id(request) not in recorder.waited:
        return True
    future = recorder.waited[id(request)]
    return future is not None and not future.done()


def _mpi_open(request) -> bool:
    """A request not null; a persistent one: started and not complete (it stays allocated after its Wait)."""
    from mpi4py import MPI

    if isinstance(request, MPI.Prequest):
        return bool(request) and not request.Get_status()
    return bool(request) and request.handle not in recorder.completed


def _started_persistent(request, frame) -> None:
    """Each start of a persistent request moves its message, and is recorded (a pair restarted every step, recorded
    at its _init calls only, was read as traffic the recording hid: 0/27); its _init call moves nothing and is
    not (a ring's sends made with Send_init and never started, beside MPI's all-reduce called unrecorded, scored
    9/9). Each start is a request to complete, its send buffer checksummed as an Isend's."""
    entry = recorder.persistent.get(getattr(request, "handle", None))
    if entry is None:
        return
    index = None
    if entry["call"] is not None:  # what the buffer holds now (its first values) goes out
        c, buf = entry["call"], entry["buf"]
        recorder.add(Call(c.name, c.dest, c.source, c.count, c.nbytes,
                          _head(buf) if buf is not None and recorder.sized else c.head, c.exact))
        index = len(recorder.calls) - 1
    if entry["share"] is not None:  # a reduce-scatter's: this rank's part of what it receives
        recorder.add(entry["share"])
    if not recorder.synchronous and index is not None:  # for rendezvous.py: where this start completes
        recorder.requested[request.handle] = index
    entry["starts"] += 1
    where = _caller(frame)
    recorder.started.append((entry["label"], request, where))
    if entry["view"] is not None:
        recorder.sending.append((request, entry["view"], _checksum(entry["view"]), entry["label"], where))


def _persistent(name: str, request, buf, noted: tuple, label: str) -> None:
    """A persistent request made (Send_init, Recv_init, ...): what each of its starts moves (_started_persistent)."""
    if getattr(request, "handle", None) is not None:  # (the wrapped call returned early while paused)
        view = _send_view(buf) if name in _SEND_INITS else None
        recorder.persistent[request.handle] = {"call": noted[0], "share": noted[1], "label": label, "view": view,
                                               "starts": 0, "buf": buf if view is not None else None}


def _patch_starts() -> None:
    """Prequest.Start and Prequest.Startall note each start (_started_persistent)."""
    from mpi4py import MPI

    d = _type_dict(MPI.Prequest)
    start, startall = d.get("Start"), d.get("Startall")
    if start is not None and not getattr(start, "_hpdl_recorded", False):
        def Start(self, _base=start):
            result = _base(self)
            if not recorder.paused_now:
                _started_persistent(self, sys._getframe(1))
            return result

        Start._hpdl_recorded = True
        d["Start"] = Start
    if isinstance(startall, classmethod) and not getattr(startall.__func__, "_hpdl_recorded", False):
        def Startall(cls, requests, _base=startall.__func__):
            result = _base(cls, requests)
            if not recorder.paused_now:
                for request in requests:
                    _started_persistent(request, sys._getframe(1))
            return result

        Startall._hpdl_recorded = True
        d["Startall"] = classmethod(Startall)
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(MPI.Prequest))


def _share_received(name: str, in_place: bool, mine) -> Call | None:
    """A reduce-scatter's share of this rank (_mine), recorded; a persistent one's is recorded at each start."""
    if name not in _SCATTERS_TO_EACH or in_place or mine is None or recorder.paused_now:
        return None
    share = _mine(name, mine)
    if not name.endswith("_init"):
        recorder.add(share)
    return share


def _mine(name: str, buf) -> Call:
    """What this rank gets of a reduce-scatter: its values, and its bytes where sends' bytes are noted."""
    return Call(f"{name}:mine", None, None, _count(buf), _nbytes(name, buf) if recorder.sized else None)


def _compacted(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The object a pickling call sends, each torch view in it a copy of its own values: pickle takes a view's
    whole storage (a shard sent by comm.allgather(new[lo:hi]) moved all n values, counted as its shard's, and
    scored 0/18), room for values no count sees. The values received are the same."""
    if "torch" not in sys.modules:  # no tensor to send: nothing to walk
        return args, kwargs
    if args:
        args = (_compact(args[0]),) + tuple(args[1:])
    for key in ("obj", "sendobj"):
        if key in kwargs:
            kwargs = {**kwargs, key: _compact(kwargs[key])}
    return args, kwargs


def _compact(obj, depth: int = 0):
    if callable(getattr(obj, "untyped_storage", None)) and callable(getattr(obj, "clone", None)):
        try:
            wider = obj.untyped_storage().nbytes() > obj.numel() * obj.element_size()
            return obj.detach().clone() if wider and not obj.requires_grad else obj
        except Exception:  # noqa: BLE001 - not a tensor after all: sent as it is
            return obj
    if depth >= 4 or type(obj) not in (list, tuple, dict) or len(obj) > 4096:
        return obj
    pairs = list(obj.items()) if type(obj) is dict else list(enumerate(obj))
    new = [(k, _compact(v, depth + 1)) for k, v in pairs]
    if all(n is v for (_, n), (_, v) in zip(new, pairs)):
        return obj
    return dict(new) if type(obj) is dict else type(obj)(n for _, n in new)


def _message(name: str, buf, dest, frame) -> tuple[str, int | None, int | None, tuple | None, int | None]:
    """What a call is noted as: (its name, the values it sends, its bytes, its first values, the bytes a value
    needs where fewer than its own: _exact). A message mpi4py.util.pkl5 makes of an object is noted as the
    object's pickled send (_pkl5_part)."""
    pickled = name[0].islower()
    count = _count(buf, pickled=pickled) if buf is not None else None
    sized = dest is not None or "llgather" in name  # an all-gather's part too: what it brings each rank
    nbytes = _nbytes(name, buf) if sized and buf is not None and recorder.sized else None
    head = _head(buf, pickled=pickled) if dest is not None and recorder.sized else None
    if dest is not None and not pickled and not _PKL5 and "mpi4py.util.pkl5" in sys.modules:
        _pkl5_capture()  # once the learner's code has imported it (at install, a ZeRO-3 rank's memory count moved)
    part = _pkl5_part(frame, buf) if dest is not None and _PKL5 and not pickled else None
    if part is not None:
        values, first = part
        return name.lower(), values, nbytes, first if recorder.sized else None, None
    exact = _framing(buf) if pickled and sized and recorder.sized else \
        _exact(buf) if dest is not None and not pickled and recorder.sized else None
    return name, count, nbytes, head, exact


NUMPY_SCALAR_FRAMING = 11  # bytes a numpy scalar's pickle in a list takes beside its own value (measured: 19 a float64)


def _framing(obj) -> int | None:
    """NUMPY_SCALAR_FRAMING where a pickled message is a list or tuple of numpy numbers (list(chunk)), each one
    value: read by its bytes at a Python float's framing (1), such a message counted 2.4 times its values and a
    ring sent so failed its size rule (21/27). None otherwise."""
    np = sys.modules.get("numpy")
    if np is None or type(obj) not in (list, tuple) or not 0 < len(obj) <= 10**6:
        return None
    ok = all(isinstance(v, np.generic) and v.dtype.kind in "biufc" for v in obj)
    return NUMPY_SCALAR_FRAMING if ok else None


def _exact(buf) -> int | None:
    """4 where a typed send's buffer is float64 and every value in it is a float32's exactly (a float32 vector
    summed in a float64 copy: right, twice the bytes, and read as twice the values: 18/27); None otherwise. Such
    a value carries no more than a float32 does, so nothing is packed in the other half."""
    data = buf[0] if isinstance(buf, (list, tuple)) and buf else buf
    try:
        import numpy as np

        if callable(getattr(data, "detach", None)):  # a tensor: to the CPU only where it is float64
            if str(getattr(data, "dtype", "")) != "torch.float64":
                return None
            data = data.detach().cpu().numpy()
        if not isinstance(data, np.ndarray) or data.dtype != np.float64 or data.size > 1 << 24:
            return None
        return 4 if np.array_equal(data.astype(np.float32).astype(np.float64), data, equal_nan=True) else None
    except Exception:  # noqa: BLE001 - unread: counted by its bytes
        return None


# -- mpi4py.util.pkl5 ------------------------------------------------------------------------

_PKL5: dict[str, Any] = {}  # pkl5's send functions as installed: their code objects and the module's globals


def _pkl5_capture() -> None:
    """pkl5's send, as the learner's code imported it: a send of an object there is three or more typed messages
    (its header of lengths, the object's pickle, each of the pickle's out-of-band buffers), each read as values: a
    ring sending through pkl5.Intracomm scored 0/27, the pickle's header counted as ~34 values a message. What its
    messages are noted as rests on their contents (_pkl5_part), not on these functions being pkl5's own."""
    try:
        from mpi4py.util import pkl5
    except Exception:  # noqa: BLE001 - an mpi4py without it: nothing to read
        return
    closure = [c for c in pkl5._isend.__code__.co_consts if isinstance(c, types.CodeType)]
    _PKL5.update(raw=pkl5._send_raw.__code__, send=pkl5._send.__code__, globals=pkl5.__dict__,
                 closure=closure[0] if len(closure) == 1 else None, pickle=pkl5.Pickle())


def _pkl5_part(frame, buf) -> tuple[int, tuple | None] | None:
    """(values, first values) of a message pkl5's own send makes of an object, called from its _send with the
    object: the header of lengths carries none; the pickle, the object's values, as a pickled send's are, or
    none where the object's arrays go as out-of-band buffers (typed messages, read by their bytes). The bytes
    a pickle has past its values are held to its slack (hooks.values_sent). None for any other message."""
    raw = frame.f_back if frame.f_code is _PKL5["closure"] else frame  # isend, ssend, sendrecv: through a closure
    outer = raw.f_back if raw is not None and raw.f_code is _PKL5["raw"] else None
    if outer is None or outer.f_code is not _PKL5["send"]:
        return None
    if raw.f_globals is not _PKL5["globals"] or outer.f_globals is not _PKL5["globals"]:
        return None
    local, obj = raw.f_locals, outer.f_locals.get("obj")
    data, bufs, info = local.get("data"), local.get("bufs"), local.get("info")
    sent = buf[0] if isinstance(buf, (list, tuple)) and buf else buf
    header, pickle = sent is info, isinstance(sent, memoryview) and sent.obj is data
    # an out-of-band buffer goes as it is (read by its bytes): only the header and the pickle are checked, the
    # object pickled again once for each
    if not (header or pickle) or not isinstance(bufs, list) or not isinstance(data, bytes) \
            or not _pickled_by_pkl5(obj, data, bufs):
        return None
    if header:
        lengths = struct.pack(f"{1 + len(bufs)}q", len(data), *(memoryview(b).nbytes for b in bufs))
        return (0, None) if info == lengths else None
    return (0, None) if bufs else (_elements(obj), _head(obj, pickled=True))


def _pickled_by_pkl5(obj, data: bytes, bufs: list) -> bool:
    """Whether `data` and `bufs` are pkl5's pickle of `obj`, by a pickler of the recorder's own: with pkl5's
    pickling replaced, a send of one value carried the whole vector, read as that one value."""
    try:
        own, own_bufs = _PKL5["pickle"].dumps_oob(obj)
        return own == data and [memoryview(b).nbytes for b in own_bufs] == [memoryview(b).nbytes for b in bufs]
    except Exception:  # noqa: BLE001 - not picklable so: not pkl5's pickle of it
        return False


def _caller(frame) -> tuple[str, int, str]:
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _sent_buffer(args, kwargs, dest, pickles: bool) -> tuple:
    """What a call sends, and whether it is a collective in place (its data is then the receive buffer); by
    position or keyword: sendrecv(sendobj=...), Allreduce(sendbuf=MPI.IN_PLACE, recvbuf=...) were noted as None."""
    buf = args[0] if args else next((kwargs[k] for k in ("buf", "obj", "sendobj", "sendbuf") if k in kwargs), None)
    in_place = dest is None and buf is not None and _is_in_place(buf)
    if in_place:
        buf = args[1] if len(args) > 1 else kwargs.get("recvbuf")
    return buf, in_place


def _plain_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A buffer call's arguments with its message specs made plain (_plain_spec): the first two by position (the
    send buffer, and a collective's receive buffer; a rank there is no spec and stays as it is) and buf, sendbuf,
    recvbuf by keyword; what is recorded is what MPI gets."""
    args = tuple(_plain_spec(a) if i < 2 else a for i, a in enumerate(args))
    return args, {k: _plain_spec(v) if k in ("buf", "sendbuf", "recvbuf") else v for k, v in kwargs.items()}


def _plain_spec(buf):
    """A buffer call's message spec as it is read here and handed to MPI (a pickled call's object is left as it
    is): its counts and displacements, anything mpi4py reads through __index__ (numpy's integers from
    np.array_split or a cumsum, a bool, an object of the learner's), as Python's ints. [x, (np.int64 count,
    displ), type] was read as the whole of x, every message a ring sent too long (0/27); a count whose __index__
    said 0 was read as the whole chunk too, while MPI sent nothing (beside a hidden all-reduce, 27/27): each is
    read once, here, and MPI gets what was read."""
    if not isinstance(buf, (list, tuple)):
        return buf
    buf = (list if isinstance(buf, list) else tuple)(buf)  # a subclass's items read once (a namedtuple too)
    if len(buf) < 2:
        return buf

    def plain(v):
        if isinstance(v, (tuple, list)) and len(v) <= 2:
            return (list if isinstance(v, list) else tuple)(plain(u) for u in v)
        if type(v) is int or not hasattr(type(v), "__index__"):
            return v
        try:
            return operator.index(v)
        except Exception:  # noqa: BLE001 - an array of counts: mpi4py reads it as it is
            return v

    return type(buf)([buf[0], *(plain(v) for v in buf[1:])])


def _wrap(cls_name: str, name: str, base, synchronous=None):
    dpos, spos = _P2P.get(name, (None, None))
    nonblocking = name[0] in "Ii" and not name.endswith("_init") and "probe" not in name.lower()
    pickles = name[:1].islower()

    def method(self, *args, **kwargs):
        if recorder.paused_now:
            return base(self, *args, **kwargs)
        args, kwargs = _plain_peers(*(_compacted(args, kwargs) if pickles else _plain_args(args, kwargs)), dpos, spos)
        dest, source = _peer(args, kwargs, dpos, "dest"), _peer(args, kwargs, spos, "source")
        buf, in_place = _sent_buffer(args, kwargs, dest, pickles)
        noted_as, count, nbytes, head, exact = _message(name, buf, dest, sys._getframe(1))
        if in_place and name in _GATHERS_IN_PLACE and isinstance(count, int):  # this rank's part of the whole
            count, nbytes = (-(-v // max(1, _size(self))) if isinstance(v, int) else None for v in (count, nbytes))
        if dest is None and name in COLLECTIVES and _alone(self):
            count, nbytes = 0, 0
        status = None
        if name in _STATUS_AT and source is None:  # from any source: recorded once it is known
            args, kwargs, status = _with_status(args, kwargs, _STATUS_AT[name])
        # a receive from any source in flight: noted when a completion says where it came from (_sourced)
        wildcard = name in _WILDCARD_RECEIVES and source is None and not recorder.forbidden.get(name)
        record = recorder.prepared if name.endswith("_init") else recorder.note  # a persistent one: at each start
        noted = record(noted_as, *_in_world(self, dest, source), count, nbytes=nbytes, head=head,
                       exact=exact) if status is None and not wildcard else None
        mine = args[1] if len(args) > 1 else kwargs.get("recvbuf")
        share = _share_received(name, in_place, mine)
        peer = (f" to rank {dest}" if dest is not None else "") + (f" from rank {source}" if source is not None else "")
        result, pickled = _call_mpi(synchronous if synchronous is not None and recorder.synchronous else base, self,
                                    args, kwargs, (noted, share), pickles, f"comm.{name}(){peer}")
        if status is not None:
            noted = recorder.note(name, *_in_world(self, dest, _source_of(status)), count, nbytes=nbytes, head=head,
                                  exact=exact)
        noted = _as_pickled(noted, pickled) if pickles else noted
        if name.endswith("_init"):
            _persistent(name, result, buf, (noted, share), f"comm.{name}(){peer}")
        if nonblocking and _open_request(result):
            recorder.completed.discard(result.handle)  # a handle MPI gives again is a new request, open
            where = _caller(sys._getframe(1))
            recorder.started.append((f"comm.{name}(){peer}", result, where))
            if not recorder.synchronous and noted is not None and recorder.calls and recorder.calls[-1] is noted:
                recorder.requested[result.handle] = len(recorder.calls) - 1  # for rendezvous.py, where sends go at once
            view = _send_view(buf) if name in _SENDS_IN_FLIGHT else None
            if view is not None:
                recorder.sending.append((result, view, _checksum(view), f"comm.{name}(){peer}", where))
                recorder.dests[id(result)] = getattr(noted, "dest", None)
        if name in BLOCKING_RECEIVES and noted is not None:
            recorder.heard_from(noted.source)
        elif name in _RECEIVES_IN_FLIGHT and noted is not None and _open_request(result):
            recorder.receiving.append((result, noted.source))
        elif wildcard and _open_request(result):
            recorder.receiving.append((result, None))
            recorder.unsourced[result.handle] = (name, count, self)
        elif wildcard:
            recorder.note(name, *_in_world(self, dest, source), count)
        return result

    method.__name__ = name
    method.__qualname__ = f"{cls_name}.{name}"
    return method


def _call_mpi(call, comm, args: tuple, kwargs: dict, noted: tuple, pickles: bool, label: str) -> tuple:
    """MPI's own call, as the learner made it: (its result, the bytes mpi4py pickled in it, or None). A call MPI
    refused (it raised) moved nothing and is withdrawn from the record, with a reduce-scatter's share (`noted`:
    both)."""
    recorder.current = label
    sizes = _pickling_begins() if pickles else None
    try:
        result = call(comm, *args, **kwargs)
    except BaseException:
        for c in noted:
            recorder.withdraw(c)
        raise
    finally:
        recorder.current = None
        pickled = _pickling_ends(sizes) if sizes is not None else None
    return result, pickled


# -- pickled messages: what mpi4py pickled -------------------------------------------------------------------

PICKLE_TOLERANCE = 256  # bytes between the recorder's pickle of an object and mpi4py's: none, measured
_PICKLING = threading.local()  # a stack: the sizes of what mpi4py pickled in each call in progress on this thread
_PICKLE_SETTINGS: dict[str, Any] = {}  # mpi4py's pickle protocol and threshold, as the recording found them


def _kit_dumps(obj, *args, **kwargs) -> bytes:
    """mpi4py's pickler while the recording runs: pickle's own, the size of each message noted for the call in
    progress (_call_mpi); not of a pickle made inside another (an object's __reduce_ex__ pickling more)."""
    import pickle

    _PICKLING.depth = getattr(_PICKLING, "depth", 0) + 1
    try:
        data = pickle.dumps(obj, *args, **kwargs)
    finally:
        _PICKLING.depth -= 1
    stack = getattr(_PICKLING, "stack", None)
    if stack and _PICKLING.depth == 0:
        stack[-1].append(len(data))
    return data


def _pickling_begins() -> list[int]:
    """The kit's pickler installed in mpi4py again (a learner's MPI.pickle.__init__ is undone: a pickler that
    sent 5 bytes of any object, the recorder pickling the object itself, made a ring's messages of decoys beside
    a hidden all-reduce: 27/27), and a list for the sizes of what this call pickles."""
    import pickle

    from mpi4py import MPI

    if not _PICKLE_SETTINGS:  # as the recording found them (an mpi4py with no THRESHOLD takes three arguments)
        _PICKLE_SETTINGS["args"] = tuple(getattr(MPI.pickle, a) for a in ("PROTOCOL", "THRESHOLD")
                                         if hasattr(MPI.pickle, a))
    MPI.pickle.__init__(_kit_dumps, pickle.loads, *_PICKLE_SETTINGS["args"])
    sizes: list[int] = []
    _PICKLING.stack = [*getattr(_PICKLING, "stack", []), sizes]
    return sizes


def _pickling_ends(sizes: list[int]) -> int | None:
    """The bytes of the first message mpi4py pickled in this call, the one a send sends (what is pickled after
    it, while the call goes on, is not: the object a sendrecv receives, unpickled, could pickle more); None
    where it pickled nothing (a receive)."""
    stack = getattr(_PICKLING, "stack", [])
    _PICKLING.stack = [s for s in stack if s is not sizes]
    return sizes[0] if sizes else None


def _as_pickled(noted: Call | None, pickled: int | None) -> Call | None:
    """A pickled call's send as recorded, by the bytes mpi4py pickled where the recorder's pickle of the object
    made others: an object whose __reduce_ex__ answered the recorder with its chunk and mpi4py with 0 was a ring's
    message of a whole chunk that moved nothing (27/27 beside a hidden all-reduce). For pickled calls only."""
    if noted is None or noted.dest is None or isinstance(pickled, int) and (
            not isinstance(noted.nbytes, int) or abs(pickled - noted.nbytes) <= PICKLE_TOLERANCE):
        return noted
    recorder.withdraw(noted)
    if pickled is None:  # no pickle seen (the kit's pickler undone, or its count stopped): counted as nothing
        return None
    measured = Call(**{**noted.__dict__, "nbytes": pickled})
    recorder.add(measured)
    return measured


def _type_dict(cls) -> dict:
    """The writable dict behind an extension type's read-only mappingproxy."""
    return gc.get_referents(cls.__dict__)[0]


def _patch_mpi(forbid_windows: bool) -> None:
    from mpi4py import MPI

    _COMM_BASE.update(inter=MPI.Comm.Is_inter, group=MPI.Comm.Get_group, remote=MPI.Intercomm.Get_remote_group,
                      size=MPI.Comm.Get_size)
    names = set(_P2P) | set(COLLECTIVES) | set(COMMUNICATOR_MAKERS)
    for cls_name in ("Comm", "Intracomm", "Intercomm", "Topocomm", "Cartcomm", "Graphcomm", "Distgraphcomm"):
        cls = getattr(MPI, cls_name, None)
        if cls is None:
            continue
        d = _type_dict(cls)
        raw = dict(d)
        for name in names & set(d):
            d[name] = _wrap(cls_name, name, d[name], raw.get(SYNCHRONOUS.get(name, "")))
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(cls))
    _patch_requests()
    _patch_starts()
    d = _type_dict(MPI.File)
    raw_open = getattr(MPI.File, "Open")

    def refuse_open(*args, **kwargs):
        recorder.note("File.Open")
        return raw_open(*args, **kwargs)

    d["Open"] = classmethod(lambda cls, *args, **kwargs: refuse_open(*args, **kwargs))
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(MPI.File))
    if forbid_windows:
        d = _type_dict(MPI.Win)
        for name in ONE_SIDED:
            if name in d:
                raw = getattr(MPI.Win, name)

                def refuse(*args, _n=name, **kwargs):
                    recorder.note(f"Win.{_n}")
                    return raw(*args, **kwargs)

                d[name] = staticmethod(refuse)
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(MPI.Win))


C_MPI = "ctypes.MPI"  # the recorder's name for a C function of MPI's looked up through ctypes
_C_MPI_PREFIXES = ("MPI_", "PMPI_", "MPIX_", "PMPIX_")


def _patch_ctypes() -> None:
    """A C function of MPI's (MPI_Allreduce, PMPI_Send, ...) looked up through ctypes or cffi is refused: a
    library's attribute or item, dlsym on its handle, a cffi library's function or variable. Any other C function
    is the learner's to call."""
    import _ctypes
    import ctypes as ct

    def guard(name) -> None:
        if isinstance(name, (str, bytes)) and not recorder.paused_now:
            text = name.decode(errors="replace") if isinstance(name, bytes) else name
            if text.startswith(_C_MPI_PREFIXES) and C_MPI in recorder.forbidden:
                recorder.forbidden.setdefault(f"ctypes.{text}", recorder.forbidden[C_MPI])
                recorder.note(f"ctypes.{text}")

    for cls in (ct.CDLL, ct.LibraryLoader):
        for method in ("__getattr__", "__getitem__"):
            raw = cls.__dict__.get(method)
            if raw is None or getattr(raw, "_hpdl_recorded", False):
                continue

            def looked_up(self, name, _raw=raw):
                guard(name)
                return _raw(self, name)

            looked_up._hpdl_recorded = True
            setattr(cls, method, looked_up)
    raw_dlsym = _ctypes.dlsym
    if not getattr(raw_dlsym, "_hpdl_recorded", False):
        def dlsym(handle, name, *rest):
            guard(name)
            return raw_dlsym(handle, name, *rest)

        dlsym._hpdl_recorded = True
        _ctypes.dlsym = dlsym
    _patch_cffi(guard)


class _LookedUp:
    """A cffi library whose functions and variables are looked up through `guard` first."""

    def __init__(self, library, guard) -> None:
        self._library, self._guard = library, guard

    def load_function(self, kind, name):
        self._guard(name)
        return self._library.load_function(kind, name)

    def read_variable(self, kind, name):
        self._guard(name)
        return self._library.read_variable(kind, name)

    def write_variable(self, kind, name, value):
        self._guard(name)
        return self._library.write_variable(kind, name, value)

    def close_lib(self):
        return self._library.close_lib()


def _patch_cffi(guard) -> None:
    """cffi's libraries (ffi.dlopen, and its backend's load_library under it) look MPI's C functions up through
    `guard`, as ctypes' do: MPI_Allgather through ffi.dlopen averaged gradients 12/12 beside a one-value
    all-reduce, and MPI_Bcast broadcast 24/24, nothing recorded."""
    try:
        import _cffi_backend
    except ImportError:  # no cffi here
        return
    raw = _cffi_backend.load_library
    if getattr(raw, "_hpdl_recorded", False):
        return

    def load_library(*args, **kwargs):
        return _LookedUp(raw(*args, **kwargs), guard)

    load_library._hpdl_recorded = True
    _cffi_backend.load_library = load_library


# -- torch.distributed ----------------------------------------------------------------------------

#: torch.distributed functions that move data between ranks, and the MPI rule each falls under
TORCH_COLLECTIVES = {
    "all_reduce": "Allreduce", "all_reduce_coalesced": "Allreduce", "reduce": "Reduce",
    "broadcast": "Bcast", "broadcast_object_list": "bcast", "all_gather": "Allgather",
    "all_gather_into_tensor": "Allgather", "_all_gather_base": "Allgather", "all_gather_object": "allgather",
    "all_gather_coalesced": "Allgather", "gather": "Gather", "gather_object": "gather", "scatter": "Scatter",
    "scatter_object_list": "scatter", "reduce_scatter": "Reduce_scatter",
    "reduce_scatter_tensor": "Reduce_scatter", "_reduce_scatter_base": "Reduce_scatter",
    "all_to_all": "Alltoall", "all_to_all_single": "Alltoall",
    "barrier": "Barrier", "monitored_barrier": "Barrier",  # no data, but messages on the wire (wire counts)
}


#: torch.distributed's messages, and the MPI rule each falls under: recorded with their peer, refused where messages
#: by hand are (hooks.SENDS). send_object_list and recv_object_list send through send and recv; batch_isend_irecv
#: through isend and irecv (its P2POps name them)
TORCH_MESSAGES = {"send": "Send", "isend": "Isend", "recv": "Recv", "irecv": "Irecv"}


#: where a torch.distributed call's data is not its first argument: its input (a reduce-scatter's output is a part)
_INPUT_AT = {"reduce_scatter": (1, "input_list"), "reduce_scatter_tensor": (1, "input"),
             "_reduce_scatter_base": (1, "input")}


def _numel(args, kwargs, name: str = "") -> int | None:
    """Elements in a torch.distributed call's data (its first argument, or the input of a reduce-scatter):
    a tensor's, or the sum over a list of tensors (all_reduce_coalesced's, reduce_scatter's)."""
    at, key = _INPUT_AT.get(name, (0, "tensor"))
    data = args[at] if len(args) > at else kwargs.get(key, kwargs.get("tensors"))
    parts = data if isinstance(data, (list, tuple)) else [data]
    numels = [getattr(t, "numel", None) for t in parts]
    return sum(int(n()) for n in numels) if numels and all(callable(n) for n in numels) else None


#: a ProcessGroup method (dist.group.WORLD.allreduce([t])) recorded as the function it does the work of
_PG_AS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced", "broadcast": "broadcast",
          "allgather": "all_gather", "reduce": "reduce", "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all",
          "alltoall_base": "all_to_all_single", "gather": "gather", "scatter": "scatter",
          "_allgather_base": "_all_gather_base", "_reduce_scatter_base": "_reduce_scatter_base", "send": "send",
          "recv": "recv", "recv_anysource": "recv"}
_in_function = threading.local()  # depth of torch.distributed functions under way: their own ProcessGroup call


#: Work methods that see a torch.distributed work through (is_completed: when it answers True). Not synchronize()
#: nor block_current_stream(): on gloo neither waits (a buffer read after synchronize() was not yet summed)
_WORK_COMPLETIONS = ("wait", "get_future", "get_future_result", "is_completed")
_MARKED_WORKS: set[type] = set()  # each Work type whose completions are marked
_WORK: list[type] = []  # torch.distributed's Work, once imported


def _started_work(call: str, work, frame) -> None:
    """An asynchronous torch.distributed call's work, to be waited on before the learner's function returns."""
    if not (_WORK and isinstance(work, _WORK[0])):
        return
    _patch_works(type(work))  # a backend's own subclass too: its wait() must be seen
    if type(work) in _MARKED_WORKS:
        recorder.waited.pop(id(work), None)  # an id a freed work had
        recorder.started.append((call, work, _caller(frame)))


def _patch_works(cls) -> None:
    """Mark each work of `cls` the learner waits on (or takes the future of, or is told is complete)."""
    if cls in _MARKED_WORKS:
        return
    for name in _WORK_COMPLETIONS:
        base = getattr(cls, name, None)
        if base is None or getattr(base, "_hpdl_recorded", False):
            continue

        def method(self, *args, _base=base, _name=name, **kwargs):
            result = _base(self, *args, **kwargs)
            if _name != "is_completed" or result:
                recorder.waited[id(self)] = result if _name == "get_future" else None
            return result

        method.__name__, method._hpdl_recorded = name, True
        try:
            setattr(cls, name, method)
        except (TypeError, AttributeError):
            return  # not marked: its works are not held open either
    _MARKED_WORKS.add(cls)


def _recorded_function(name: str, rule: str, base):
    """torch.distributed's `name`, recorded (or refused) as the MPI call it does the work of; its work, if
    asynchronous, to be waited on."""
    def fn(*args, **kwargs):
        recording = not recorder.paused_now
        if recording:
            _refuse_torch(f"torch.distributed.{name}", name, rule)
            recorder.add(_torch_call(name, args, kwargs))
        _in_function.depth = getattr(_in_function, "depth", 0) + 1
        try:
            result = base(*args, **kwargs)
        finally:
            _in_function.depth -= 1
        if recording:
            _started_work(f"dist.{name}()" if name in TORCH_MESSAGES else f"dist.{name}(async_op=True)", result,
                          sys._getframe(1))
        return result

    fn.__name__, fn.__qualname__, fn._hpdl_recorded = name, name, True
    return fn


def _refuse_torch(called: str, name: str, rule: str) -> None:
    """Raise ForbiddenCall, naming `called`, where the exercise forbids torch.distributed's `name` or its MPI rule."""
    reason = recorder.forbidden.get(f"torch.distributed.{name}") or recorder.forbidden.get(rule)
    if reason:
        recorder.rejected.append(called)
        raise ForbiddenCall(called, reason)


def _torch_call(name: str, args, kwargs) -> Call:
    """A torch.distributed call as recorded: its data's elements; a message's peer too, and a send's elements
    (unrecorded, torch's send and recv moved an average to rank 0 and back beside an all-reduce of zeros, full
    marks where messages by hand are refused)."""
    if name not in TORCH_MESSAGES:
        return Call(name, count=_numel(args, kwargs, name))
    peer, sends = _torch_peer(args, kwargs, name), "send" in name
    return Call(name, dest=peer if sends else None, source=None if sends else peer,
                count=_numel(args, kwargs) if sends else None)


def _torch_peer(args, kwargs, name: str) -> int | None:
    """The rank a torch.distributed message goes to (dst) or comes from (src; None: from any)."""
    key = "dst" if "send" in name else "src"
    peer = args[1] if len(args) > 1 else kwargs.get(key, kwargs.get(f"group_{key}"))
    return peer if isinstance(peer, int) else None


def _patch_c10d(c10d) -> None:
    work = getattr(c10d, "Work", None)
    if work is not None and not _WORK:
        _WORK.append(work)
        _patch_works(work)
    for name, rule in [*TORCH_COLLECTIVES.items(), *TORCH_MESSAGES.items()]:
        base = getattr(c10d, name, None)
        if base is None or getattr(base, "_hpdl_recorded", False):
            continue

        fn = _recorded_function(name, rule, base)
        setattr(c10d, name, fn)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and getattr(dist, name, None) is base:
            setattr(dist, name, fn)
    for cls_name in ("ProcessGroup",):  # the object-level route: dist.group.WORLD.allreduce(...)
        cls = getattr(c10d, cls_name, None)
        for method in ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "reduce", "reduce_scatter",
                       "alltoall", "alltoall_base", "gather", "scatter", "_allgather_base", "_reduce_scatter_base",
                       "send", "recv", "recv_anysource"):
            base = getattr(cls, method, None) if cls is not None else None
            if base is None or getattr(base, "_hpdl_recorded", False):
                continue
            rule = {"allreduce": "Allreduce", "allreduce_coalesced": "Allreduce", "broadcast": "Bcast",
                    "reduce": "Reduce", "send": "Send", "recv": "Recv", "recv_anysource": "Recv"}
            rule = rule.get(method, "Allgather")

            def pg(self, *args, _m=method, _rule=rule, _base=base, **kwargs):
                # called by the learner, not by dist.all_reduce
                learners = not recorder.paused_now and not getattr(_in_function, "depth", 0)
                if not recorder.paused_now:
                    reason = recorder.forbidden.get(f"ProcessGroup.{_m}") or recorder.forbidden.get(_rule)
                    if reason:
                        recorder.rejected.append(f"ProcessGroup.{_m}")
                        raise ForbiddenCall(f"ProcessGroup.{_m}", reason)
                    if learners:
                        # (unrecorded, an all-reduce by this route failed right code: "no all-reduce was seen")
                        name = _PG_AS.get(_m, _m)
                        recorder.add(Call(name, count=_numel(args, kwargs, name)))
                result = _base(self, *args, **kwargs)
                if learners:
                    _started_work(f"ProcessGroup.{_m}()", result, sys._getframe(1))
                return result

            pg._hpdl_recorded = True
            try:
                setattr(cls, method, pg)
            except (TypeError, AttributeError):
                break  # an immutable binding: the function-level route above still records
    _patch_torch_ops()
    recorder.torch_hooked = True


#: torch's collective operators, called by name (torch.ops.<namespace>.<op>) rather than through the functions
#: above: the functional collectives (torch.distributed._functional_collectives, DTensor) call _c10d_functional's,
#: and c10d's are the process group's own. Each is recorded as the function it does the work of (unrecorded, an
#: average by _functional_collectives.all_gather_tensor beside an all-reduce of zeros scored full marks in
#: allreduce_gradients and overlap_allreduce)
TORCH_OPS = {
    "_c10d_functional": {
        **dict.fromkeys(("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"),
                        ("all_reduce", "Allreduce")),
        # its input is this rank's part (c10d's all_gather_into_tensor is counted by its output, every part)
        **dict.fromkeys(("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
                        ("all_gather_single", "Allgather")),
        **dict.fromkeys(("reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"),
                        ("reduce_scatter_tensor", "Reduce_scatter")),
        "all_to_all_single": ("all_to_all_single", "Alltoall"), "broadcast": ("broadcast", "Bcast"),
        "broadcast_": ("broadcast", "Bcast"), "isend": ("isend", "Isend"), "irecv": ("irecv", "Irecv"),
        "batch_p2p_ops": ("isend", "Isend")},
    # the process group's own (its first argument is not always the data: counted where it is a list of tensors)
    "c10d": {
        **{op: ("all_reduce", "Allreduce") for op in ("allreduce_", "allreduce_coalesced_")},
        **{op: ("all_gather", "Allgather") for op in ("allgather_", "_allgather_base_", "allgather_coalesced_",
                                                       "allgather_into_tensor_coalesced_")},
        **{op: ("reduce_scatter", "Reduce_scatter") for op in ("reduce_scatter_", "_reduce_scatter_base_",
                                                               "reduce_scatter_tensor_coalesced_")},
        "alltoall_": ("all_to_all", "Alltoall"), "alltoall_base_": ("all_to_all_single", "Alltoall"),
        "broadcast_": ("broadcast", "Bcast"), "reduce_": ("reduce", "Reduce"), "gather_": ("gather", "Gather"),
        "scatter_": ("scatter", "Scatter"), "send": ("send", "Send"), "recv_": ("recv", "Recv"),
        "recv_any_source_": ("recv", "Recv")},
}


class _RecordedOp:
    """A torch operator (its packet, or one of its overloads: .default) that records each call made outside the
    torch.distributed functions recorded above, as the function `name`, or refuses it under that function's rule."""

    def __init__(self, op, qualified: str, name: str, rule: str):
        self._op, self._qualified, self._name, self._rule = op, qualified, name, rule

    def __call__(self, *args, **kwargs):
        if not recorder.paused_now and not getattr(_in_function, "depth", 0):
            _refuse_torch(self._qualified, self._name, self._rule)
            recorder.add(Call(self._name, count=_numel(args[:1], {})))
        return self._op(*args, **kwargs)

    def __getattr__(self, attr: str):
        value = getattr(self._op, attr)
        overloads = getattr(self._op, "overloads", None)
        recorded = callable(overloads) and attr in overloads()
        return _RecordedOp(value, self._qualified, self._name, self._rule) if recorded else value


def _patch_torch_ops() -> None:
    """Wrap torch's collective operators (TORCH_OPS) in torch.ops. torch.distributed is imported while torch itself
    still is, before torch._ops has made torch.ops (ranks that import torch themselves, not forks of a server that
    did): then just before the learner's function runs (ready_for_learner). Those already wrapped are left."""
    ops = getattr(sys.modules.get("torch._ops"), "ops", None)
    if ops is None:
        return
    for space, names in TORCH_OPS.items():
        namespace = getattr(ops, space, None)
        for op, (name, rule) in names.items():
            try:
                packet = getattr(namespace, op)
            except (AttributeError, RuntimeError):
                continue  # not in this torch
            if not isinstance(packet, _RecordedOp):
                setattr(namespace, op, _RecordedOp(packet, f"torch.ops.{space}.{op}", name, rule))


def ready_for_learner() -> None:
    """Just before the learner's function runs: torch's operators wrapped, if torch is imported and they are not yet
    (torch.distributed was imported while torch itself was)."""
    if recorder.torch_hooked:
        _patch_torch_ops()


class _TorchHook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patch torch.distributed's collectives the moment the module is imported, by anyone (or call `then` on
    another module the moment it is imported)."""

    TARGET = "torch.distributed.distributed_c10d"

    def __init__(self, target: str = TARGET, then=None):
        self.target, self.then = target, then or _patch_c10d

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._real = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        self._real.exec_module(module)
        self.then(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)


INSTALLED: dict[str, str] = {}  # the calls forbidden as installed: the learner job takes them before any learner's code


def install(forbidden: dict[str, str], sized: bool = False, synchronous: bool = True) -> None:
    """Once per learner process, before the learner's code is unpacked. `sized`: note each send's
    bytes too (a METERED check compares them with what the kernel saw). `synchronous`: a blocking Send
    waits for its receive (SYNCHRONOUS)."""
    recorder.sized, recorder.synchronous = sized, synchronous
    recorder.reset(forbidden)
    forbid_windows = _forbid_routes(forbidden)
    if not recorder.installed:
        _patch_mpi(forbid_windows)
        _patch_ctypes()
        c10d = sys.modules.get(_TorchHook.TARGET)
        if c10d is not None:
            _patch_c10d(c10d)
        else:
            sys.meta_path.insert(0, _TorchHook())
        recorder.installed = True
    INSTALLED.clear()
    INSTALLED.update(recorder.forbidden)


def _forbid_routes(forbidden: dict[str, str]) -> bool:
    """The routes around the calls `forbidden` names, forbidden too; whether windows are among them."""
    forbid_windows = any(n in forbidden for n in ("Allreduce", "Reduce", "Bcast", "Allgather"))
    if forbid_windows:
        for name in ONE_SIDED:
            recorder.forbidden.setdefault(f"Win.{name}", "one-sided MPI (windows, shared memory) moves data no "
                                                         "check can follow: use the calls the exercise names "
                                                         "(point-to-point messages, or the collective it asks for)")
    # MPI-IO's collective reads and writes move data between ranks (its aggregators), and MPI's C functions
    # called through ctypes are mpi4py's calls unrecorded: an allgather through MPI.File, or MPI_Allreduce on
    # the learner's comm.handle, scored 24/27 on ring_allreduce, the small cases' bytes under the wire's slack
    recorder.forbidden.setdefault("File.Open", "MPI-IO (MPI.File) moves data between ranks that no check can "
                                               "follow: use the calls the exercise names (point-to-point "
                                               "messages, or the collective it asks for)")
    recorder.forbidden.setdefault(C_MPI, "MPI's C functions called by hand (ctypes, cffi) are calls no check "
                                         "can follow: call MPI through mpi4py (point-to-point messages, or the "
                                         "collective the exercise asks for)")
    return forbid_windows


def sends(calls: list[Any]) -> list[int]:
    return [c.dest for c in calls if getattr(c, "dest", None) is not None]
