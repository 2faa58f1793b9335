"""Learner's ranks: a helper process that holds what the learner's function must not see.

Some exercises hand the learner's function an object whose behaviour is the answer (a step that
costs a set time per sample): kept in the learner's process, its settings are the answer too,
one attribute or frame away. For a case module with ORACLE = True the client writes each rank's
secrets to JOB_DIR/oracle-<rank>.bin; before the learner's code is unpacked, the rank forks this
helper, which reads and removes that file, makes itself unreadable to other processes
(PR_SET_DUMPABLE 0; the sandbox's seccomp filter forbids ptrace) and answers requests with the
module's serve(request, secrets). The learner's process holds only a socket: `ask()`.

Requests and answers are one JSON object per line, never pickles: the helper runs no code the
learner sends. It ends when its rank does (PR_SET_PDEATHSIG, and the socket closing).
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
from typing import Any, Callable

PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
MAX_LINE = 1 << 16

_sock: socket.socket | None = None
_file = None


def start(path: str, serve: Callable[[dict, Any], dict]) -> None:
    """Fork the helper for this rank's secrets at `path`; return once it has read and removed them."""
    global _sock, _file
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the helper: never returns
        parent.close()
        code = 0
        try:
            _serve_forever(child, path, serve)
        except BaseException:
            code = 1
        os._exit(code)
    child.close()
    if parent.recv(1) != b"R":
        raise RuntimeError("the checker's helper process did not start")
    _sock, _file = parent, parent.makefile("rwb")


def _serve_forever(sock: socket.socket, path: str, serve) -> None:
    from hpdl.checker import wire

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    with open(path, "rb") as f:
        secrets = wire.unpack(f.read())
    os.remove(path)
    sock.sendall(b"R")
    stream = sock.makefile("rwb")
    while True:
        line = stream.readline(MAX_LINE)
        if not line:
            return
        try:
            request = json.loads(line)
            answer = serve(request, secrets) if isinstance(request, dict) else {"error": "not a request"}
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        stream.write(json.dumps(answer).encode() + b"\n")
        stream.flush()


def key(kind: str, params: dict, case_name: str) -> str:
    """The key a helper signs its receipts with: drawn from the check's nonce, which only the checker's side
    and the helper know (and the learner's process never does)."""
    import hashlib

    return hashlib.sha256(f"{kind}:{params.get('nonce')}:{case_name}".encode()).hexdigest()


def signed(body: dict, secret: str) -> dict:
    """In the helper: `body` as a receipt the learner's process can hand on, but not make up or alter."""
    import hmac

    text = json.dumps(body, sort_keys=True)
    return {"body": text, "mac": hmac.new(secret.encode(), text.encode(), "sha256").hexdigest()}


def sealed(value, secret: str) -> str:
    """In the helper: `value` (JSON) as text the learner's process can hand on but not read: XORed with a
    keystream drawn from `secret` and a salt (SHA-256 in counter mode). A receipt's body is the learner's to read
    (signed only): the steps' seconds in it were a meter's answer, read off step.receipt() with no clock (7/7)."""
    import base64

    salt = os.urandom(16)
    data = json.dumps(value).encode()
    return base64.b64encode(salt + bytes(a ^ b for a, b in zip(data, _keystream(secret, salt, len(data))))).decode()


def unsealed(text, secret: str):
    """On the checker's side: the value sealed() sealed with `secret`; None where it cannot be read."""
    import base64

    from hpdl import safefiles

    try:
        raw = base64.b64decode(text, validate=True)
        salt, data = raw[:16], raw[16:]
        return safefiles.json_of(bytes(a ^ b for a, b in zip(data, _keystream(secret, salt, len(data)))))
    except (TypeError, ValueError):
        return None


def _keystream(secret: str, salt: bytes, n: int) -> bytes:
    import hashlib

    blocks = (hashlib.sha256(secret.encode() + salt + i.to_bytes(8, "big")).digest() for i in range(-(-n // 32)))
    return b"".join(blocks)[:n]


def receipt_body(receipt, secret: str | None) -> dict | None:
    """The body of a receipt (signed()) whose signature holds; None where it is missing or altered.
    `secret` None: taken unchecked (a check without a nonce, a stripped kit's public cases: the learner's
    own inline check, which nothing is at stake in)."""
    import hmac

    from hpdl import safefiles

    if not isinstance(receipt, dict) or not isinstance(receipt.get("body"), str) \
            or not isinstance(receipt.get("mac"), str):
        return None
    if secret is not None:
        mac = hmac.new(secret.encode(), receipt["body"].encode(), "sha256").hexdigest()
        if not hmac.compare_digest(mac, receipt["mac"]):
            return None
    try:
        body = safefiles.json_of(receipt["body"])
    except ValueError:  # a body of the learner's making, where no signature is checked
        return None
    return body if isinstance(body, dict) else None


def running() -> bool:
    return _file is not None


def ask(request: dict) -> dict:
    """The helper's answer to one request (RuntimeError when it is gone)."""
    if _file is None:
        raise RuntimeError("no helper process in this rank")
    _file.write(json.dumps(request).encode() + b"\n")
    _file.flush()
    line = _file.readline(MAX_LINE)
    if not line:
        raise RuntimeError("the checker's helper process is gone")
    answer = json.loads(line)
    if "error" in answer:
        raise RuntimeError(f"the checker's helper process refused: {answer['error']}")
    return answer
