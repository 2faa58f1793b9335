"""Open files safely in a folder someone untrusted can write (a submission's, a learner job's).

Why: the grader and the checker's trusted side read what a learner's process left in a folder
(check requests, events, outputs, a notebook's status) and write files next to it. A learner
who can write that folder can put there, in place of the file we expect, a symbolic link (to
the instructor's ~/.bashrc, to /dev/zero), a FIFO (whose open blocks for ever), a device or a
huge file. So every open here:

- never follows a symbolic link in the last component (O_NOFOLLOW) and never blocks (O_NONBLOCK);
- reads only regular files (checked on the open descriptor with fstat, not on the path, so
  nothing can be swapped in between) and never more than a bound the caller names;
- creates only with O_CREAT|O_EXCL|O_NOFOLLOW: a name already there, link or not, is an error,
  never a file written through; a file meant to appear whole is written under a fresh random
  name first and renamed (a rename replaces a link, it never writes through it).

`dir_fd` pins a folder opened once (`open_dir`): renaming the folder away and putting a link
in its place then changes nothing for us. Standard library only (ranks may import it).
"""
from __future__ import annotations

import errno
import os
import stat
import uuid

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeFile(OSError):
    """A file we were to read or create is not what it must be (a link, a FIFO, a device, too large)."""


def open_dir(path: str | os.PathLike) -> int:
    """A descriptor of the folder `path` (not following a link there): pass it as dir_fd."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UnsafeFile(exc.errno, f"{path} is not a folder (a symbolic link?): {exc.strerror}") from None


def open_to_owner(path: str | os.PathLike) -> None:
    """Give the folder `path` back to its owner (u+rwx), never following a link there: a learner's
    process may close a folder of its own to everyone (chmod 000) to hide what it holds, or to keep
    it from being removed. A link put in its place meanwhile changes nothing (O_PATH|O_NOFOLLOW)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def remove_tree(path: str | os.PathLike) -> None:
    """shutil.rmtree through folders their owner closed to itself (open_to_owner: only `path` and
    folders in it, never one above); what still cannot be removed is left (a cleanup never fails)."""
    import shutil

    top = os.path.abspath(path)
    tried: set[str] = set()  # each failure retried once: a folder that stays closed is left

    def reopen(_func, failed: str, _exc) -> None:
        failed = os.path.abspath(failed)
        if failed in tried:
            return
        tried.add(failed)
        for folder in (os.path.dirname(failed), failed):  # to remove in it, then to list it
            if folder == top or folder.startswith(top + os.sep):
                try:
                    open_to_owner(folder)
                except OSError:  # not a folder (a file, a link): nothing to open
                    pass
        try:
            if os.path.isdir(failed) and not os.path.islink(failed):
                shutil.rmtree(failed, onerror=reopen)  # folders closed further down, at any depth
            else:
                os.unlink(failed)
        except OSError:
            pass

    shutil.rmtree(top, onerror=reopen)
    if os.path.lexists(top):  # its parent-most folders were opened while it was read: now they go
        tried.clear()
        shutil.rmtree(top, onerror=reopen)


def open_regular(path: str | os.PathLike, *, dir_fd: int | None = None) -> int:
    """A read descriptor of the regular file `path`; UnsafeFile for a link, FIFO, device, folder."""
    try:
        fd = os.open(path, _READ, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symbolic link
            raise UnsafeFile(exc.errno, f"{os.fspath(path)} is a symbolic link; not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EINVAL, f"{os.fspath(path)} is not a regular file ({_kind(st.st_mode)}); not read")
        os.set_blocking(fd, True)  # a regular file: reads never block anyway
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str | os.PathLike, limit: int, *, dir_fd: int | None = None, offset: int = 0,
                 too_large: str = "error") -> bytes:
    """At most `limit` bytes of the regular file `path`, from `offset`.

    too_large="error": a file with more than `limit` bytes from `offset` raises UnsafeFile;
    "cut": its first `limit` bytes are returned (a log read in pieces)."""
    fd = open_regular(path, dir_fd=dir_fd)
    try:
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        if too_large != "cut":
            raise UnsafeFile(errno.EFBIG, f"{os.fspath(path)} holds more than {limit} bytes; not read")
        data = data[:limit]
    return data


def create_exclusive(path: str | os.PathLike, data: bytes | str, *, dir_fd: int | None = None,
                     mode: int = 0o600) -> None:
    """Create `path` with `data`; FileExistsError when anything (a link included) has that name."""
    fd = os.open(path, _CREATE, mode, dir_fd=dir_fd)
    try:
        view = memoryview(data.encode() if isinstance(data, str) else data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def replace_atomically(path: str, data: bytes | str, *, dir_fd: int | None = None, mode: int = 0o600) -> None:
    """Make `path` (a plain name when `dir_fd` is given) hold `data`, never half written: a fresh
    random name created exclusively, then renamed over `path` (replacing a link, not following it)."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")
    create_exclusive(tmp, data, dir_fd=dir_fd, mode=mode)
    try:
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass  # gone already: nothing of ours is left
        raise


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a regular file"


__all__ = ["UnsafeFile", "open_dir", "open_regular", "read_bounded", "create_exclusive", "replace_atomically"]
