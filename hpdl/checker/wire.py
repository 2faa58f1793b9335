"""What crosses from the learner's ranks to the checker: plain data, read without running code.

The learner's process is not trusted: whatever it returns is turned into plain data on its
side (`pack`: numbers, strings, lists, dicts, numpy arrays; a torch tensor as its array and
dtype; a torch module as its named parameters and buffers; anything else as its type name
and repr), and the checker reads the bytes back with a restricted unpickler (`unpack`) that
builds only those things. A pickle written by hand to run code on the checker's side finds
no class it may call. Rank side and checker side both import this module; it stays light.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

MAX_BYTES = 512 * 2**20  # a learner's outputs for one case; more is refused, not read
MAX_DEPTH = 64


class Opaque:
    """Something the learner returned that is not plain data: its type and a short repr."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = str(type_name), str(text)

    def __repr__(self) -> str:
        return f"<{self.type_name}: {self.text}>"

    def __eq__(self, other) -> bool:
        return isinstance(other, Opaque) and (self.type_name, self.text) == (other.type_name, other.text)

    __hash__ = None


class Module:
    """A torch module as it came back from the learner's ranks: its parameters and buffers.

    Enough for the checks' helpers (parameters(), named_parameters(), state_dict(), buffers());
    `m.weight` or `m.layer.bias` reach a parameter by name.
    """

    def __init__(self, type_name: str, params: list, buffers: list):
        self.type_name = str(type_name)
        self._params = [(str(k), v) for k, v in params]
        self._buffers = [(str(k), v) for k, v in buffers]

    def parameters(self):
        return iter([v for _, v in self._params])

    def named_parameters(self):
        return iter(list(self._params))

    def buffers(self):
        return iter([v for _, v in self._buffers])

    def state_dict(self) -> dict:
        return dict(self._params + self._buffers)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        found = dict(self._params + self._buffers)
        if name in found:
            return found[name]
        prefix = name + "."
        sub = [(k[len(prefix):], v) for k, v in self._params if k.startswith(prefix)]
        subb = [(k[len(prefix):], v) for k, v in self._buffers if k.startswith(prefix)]
        if sub or subb:
            return Module(f"{self.type_name}.{name}", sub, subb)
        raise AttributeError(f"the returned {self.type_name} has no parameter or submodule {name!r}")

    def __repr__(self) -> str:
        return f"<{self.type_name} with {len(self._params)} parameters>"


def tensor(array, dtype: str, requires_grad: bool = False):
    """On the checker's side: a torch tensor again (torch is imported only when one came back)."""
    import numpy as np
    import torch

    t = torch.from_numpy(np.array(array, copy=True))
    wanted = getattr(torch, str(dtype).replace("torch.", ""), None)
    if isinstance(wanted, torch.dtype) and t.dtype != wanted:
        t = t.to(wanted)
    return t.requires_grad_(bool(requires_grad)) if t.is_floating_point() else t


# -- the learner's side ----------------------------------------------------------------------

def _plain(obj: Any, depth: int = 0) -> Any:
    import numpy as np

    if depth > MAX_DEPTH:
        return Opaque("too deep", "nested more than 64 levels")
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return obj if type(obj) in (bool, int, float, complex, str, bytes) else _builtin(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            return np.array([_plain(x, depth + 1) for x in obj.ravel()], dtype=object).reshape(obj.shape)
        return np.ascontiguousarray(obj)
    if isinstance(obj, np.generic):
        return obj if not isinstance(obj, np.object_) else _plain(obj.item(), depth + 1)
    if type(obj) in (list, tuple) or isinstance(obj, (list, tuple)):
        items = [_plain(x, depth + 1) for x in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if isinstance(obj, (set, frozenset)):
        return {_plain(x, depth + 1) for x in obj if _hashable(x)}
    if isinstance(obj, dict):
        return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in obj.items() if _hashable(k)}
    torch_form = _torch(obj)
    if torch_form is not None:
        return torch_form
    try:
        text = repr(obj)[:200]
    except Exception as exc:  # a learner's __repr__ that raises
        text = f"(repr raised {type(exc).__name__})"
    return Opaque(type(obj).__qualname__, text)


def _builtin(obj):
    """A subclass of int/float/str...: its plain value (a subclass's methods stay behind)."""
    for kind in (bool, int, float, complex, str, bytes):
        if isinstance(obj, kind):
            return kind(obj)
    return obj


def _hashable(x) -> bool:
    return x is None or isinstance(x, (bool, int, float, complex, str, bytes, tuple))


class _Tensor:
    def __init__(self, array, dtype: str, requires_grad: bool):
        self.args = (array, dtype, requires_grad)

    def __reduce__(self):
        return (tensor, self.args)


def _torch(obj):
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        dtype = str(t.dtype)
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float() if t.dtype == torch.bfloat16 else t
        return _Tensor(t.contiguous().numpy().copy(), dtype, bool(obj.requires_grad))
    if isinstance(obj, torch.nn.Module):
        params = [(k, _torch(v)) for k, v in obj.named_parameters()]
        buffers = [(k, _torch(v)) for k, v in obj.named_buffers()]
        return Module(type(obj).__qualname__, params, buffers)
    return None


def pack(obj: Any) -> bytes:
    """Learner's side: `obj` as plain data, pickled."""
    return pickle.dumps(_plain(obj), protocol=4)


# -- the checker's side ------------------------------------------------------------------------

# Nothing here makes more than the pickle holds: no constructor that takes a size (bytearray(n),
# range(n) made into an array), and an empty array's shape is bounded by the bytes read (_Restricted).
_ALLOWED = {
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "slice"),
    ("collections", "OrderedDict"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("hpdl.checker.wire", "Opaque"), ("hpdl.checker.wire", "Module"), ("hpdl.checker.wire", "tensor"),
}


class _Restricted(pickle.Unpickler):
    """Builds only plain data, and no array or scalar larger than the bytes it reads: numpy's own
    pickles make each array empty, then fill it from bytes in the pickle, so an array whose shape asks
    for more (filled later by a copy on the checker's side) was written by hand to take its memory."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.budget = len(data)

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            found = super().find_class(module, name)
            return self._bounded(found) if name in ("_reconstruct", "scalar") else found
        if module.startswith("numpy") and name.endswith("DType"):  # numpy 2's dtype classes
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")

    def _bounded(self, make):
        import math

        import numpy as np

        budget = self.budget  # not self: the memo keeps this function, and self the memo and the bytes read

        def bounded(kind, *args):
            if make.__name__ == "scalar":  # scalar(dtype, bytes)
                size = np.dtype(kind).itemsize
            else:  # _reconstruct(ndarray, shape, dtype)
                shape, dtype = (tuple(args[0]) if isinstance(args[0], (tuple, list)) else (args[0],)), args[1]
                size = math.prod(int(n) for n in shape) * np.dtype(dtype).itemsize
            if size > budget:
                raise pickle.UnpicklingError(f"an array of {size} bytes from a pickle of {budget}")
            return make(kind, *args)

        return bounded


class NotPlainData(ValueError):
    """The bytes from a learner's rank could not be read as plain data."""


def unpack(data: bytes) -> Any:
    """Checker's side: plain data back from bytes a learner's process wrote; never runs its code."""
    if len(data) > MAX_BYTES:
        raise NotPlainData(f"{len(data) / 2**20:.0f} MiB of output (at most {MAX_BYTES // 2**20} MiB)")
    try:
        return _Restricted(data).load()
    except NotPlainData:
        raise
    except Exception as exc:
        raise NotPlainData(f"{type(exc).__name__}: {str(exc)[:200]}") from None
