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

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
import uuid

#: how deeply a JSON text from such a folder may nest. A notebook nests about 8 levels (a plot's or a
#: widget's output data some more). Python's json recurses once per level and past ~1000 raises
#: RecursionError, not ValueError, from a text of 2 KB: one such file would end whatever read it (a
#: whole grading batch). Data just under that depth could not be written again deeper in the stack.
JSON_DEPTH = 100
JSON_CONTAINERS = 1 << 21  # objects and lists (a notebook holds thousands; each costs ~60 bytes parsed, more as a dict)
JSON_ITEMS = 1 << 22  # values in lists and objects, strings aside: a small int costs 8 bytes parsed, a float 32
JSON_STRINGS = 1 << 21  # strings, keys too (a notebook's lines: each ~60 bytes parsed)

MAX_OPEN_FOLDERS = 64  # remove_tree: descriptors held at once, one per level it has gone down

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
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


def open_to_owner(path: str | os.PathLike, *, dir_fd: int | None = None) -> None:
    """Give the folder `path` back to its owner (u+rwx), never following a link there: a learner's
    process may close a folder of its own to everyone (chmod 000) to hide what it holds, or to keep
    it from being removed. A link put in its place meanwhile changes nothing (O_PATH|O_NOFOLLOW)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def remove_tree(path: str | os.PathLike) -> None:
    """Remove the folder `path` and all it holds; a cleanup never fails: what cannot go is left.

    Without recursion: a learner's process can make a tree a thousand folders deep, past Python's
    recursion limit, which shutil.rmtree's and os.walk's recursion met: one such folder ended a
    grading batch. Folders are opened by descriptor, never through a link (O_NOFOLLOW), at most
    MAX_OPEN_FOLDERS at once: one deeper is first moved up into `path` itself (a rename on the
    same file system) and removed from there. Folders its owner closed to itself are given back
    to the owner (open_to_owner), `path` and the folders in it only, never one above."""
    top = os.path.abspath(path)
    if not os.path.lexists(top):
        return
    if os.path.islink(top) or not os.path.isdir(top):
        with contextlib.suppress(OSError):
            os.unlink(top)
        return
    try:
        above = os.open(os.path.dirname(top), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # never listed
    except OSError:
        return
    try:
        first = _enter(above, os.path.basename(top))
    finally:
        os.close(above)
    if first is None:
        return
    stack: list[list] = [[first, None, top]]  # [descriptor, sub-folders still to remove, name]
    while stack:
        frame = stack[-1]
        if frame[1] is None:  # list it once: files go now, folders wait their turn
            frame[1] = _empty_of_files(frame[0])
        if frame[1]:
            name = frame[1].pop()
            if len(stack) >= MAX_OPEN_FOLDERS:
                moved = f".hpdl-removing-{uuid.uuid4().hex}"
                with contextlib.suppress(OSError):
                    os.rename(name, moved, src_dir_fd=frame[0], dst_dir_fd=stack[0][0])
                    stack[0][1].append(moved)
                continue
            inner = _enter(frame[0], name)
            if inner is not None:
                stack.append([inner, None, name])
            continue
        os.close(frame[0])
        stack.pop()
        with contextlib.suppress(OSError):  # a cleanup leaves what it cannot remove
            if stack:
                os.rmdir(frame[2], dir_fd=stack[-1][0])
            else:
                os.rmdir(top)


def _enter(folder_fd: int, name: str) -> int | None:
    """A descriptor of the folder `name` in `folder_fd` (no link followed), given back to its owner
    first when it was closed; None when it cannot be opened."""
    try:
        try:
            fd = os.open(name, _FOLDER, dir_fd=folder_fd)
        except PermissionError:
            open_to_owner(name, dir_fd=folder_fd)
            fd = os.open(name, _FOLDER, dir_fd=folder_fd)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o700)  # u+w too: a folder left read-only could not be emptied
    return fd


def _empty_of_files(folder_fd: int) -> list[str]:
    """Unlink everything in the folder but its sub-folders; their names."""
    folders = []
    with contextlib.suppress(OSError), os.scandir(folder_fd) as entries:
        for entry in entries:
            try:
                is_folder = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_folder = False
            if is_folder:
                folders.append(entry.name)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.name, dir_fd=folder_fd)
    return folders


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


def read_beneath(root: str | os.PathLike, relative: str | os.PathLike, limit: int, **kwargs) -> bytes:
    """read_bounded of the file `relative` under the folder `root`, no link followed at any of its levels: a
    learner's folder swapped for a link to another's after the listing had another's notebook graded as its
    own (O_NOFOLLOW guards the last level only)."""
    *folders, name = Path(relative).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for folder in folders:
            try:
                inner = os.open(folder, _FOLDER, dir_fd=fd)
            except OSError as exc:
                raise UnsafeFile(exc.errno, f"{folder} in {os.fspath(relative)} is not a folder (a symbolic "
                                            f"link?): {exc.strerror}") from None
            os.close(fd)
            fd = inner
        return read_bounded(name, limit, dir_fd=fd, **kwargs)
    finally:
        os.close(fd)


HOLES_SLACK = 1 << 16  # bytes a file's size may exceed what its blocks hold and still count as written whole


def read_bounded(path: str | os.PathLike, limit: int, *, dir_fd: int | None = None, offset: int = 0,
                 too_large: str = "error", written: bool = False) -> bytes:
    """At most `limit` bytes of the regular file `path`, from `offset`.

    too_large="error": a file with more than `limit` bytes from `offset` raises UnsafeFile;
    "cut": its first `limit` bytes are returned (a log read in pieces).
    written=True: only bytes that were written, and no more than the file held when opened: a file with
    holes (truncated to a size it never wrote: next to nothing on disk) raises UnsafeFile, since a copy
    of it would take for real the disk its holes do not."""
    fd = open_regular(path, dir_fd=dir_fd)
    try:
        if written:
            st = os.fstat(fd)
            if st.st_size > st.st_blocks * 512 + HOLES_SLACK:
                raise UnsafeFile(errno.EFBIG, f"{os.fspath(path)} has holes ({st.st_size} bytes long, "
                                              f"{st.st_blocks * 512} written); not read")
            limit = min(limit, max(0, st.st_size - offset))
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


def json_of(data: bytes | str, max_depth: int = JSON_DEPTH, max_containers: int = JSON_CONTAINERS,
            max_items: int = JSON_ITEMS, max_strings: int = JSON_STRINGS) -> object:
    """The value of a JSON text someone untrusted wrote. ValueError for anything else, a text nested
    more than `max_depth` deep included, so that a caller catches one kind of error for all of it.
    Its shape is counted before anything is built (refuse_past_shape), and one past a bound is not read: a 64 MiB
    notebook of 22 million empty cells took 1.9 GB and 20 s of the grader's loop to parse, one of 16 million
    numbers in a flat list 1.2 GB, each of the times the grader read it."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    refuse_past_shape(raw, max_strings, max_items, max_containers)
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested too deep to read (more than {max_depth} levels)") from None
    level, depth = ([value] if isinstance(value, (dict, list)) else []), 1
    while level:  # one level at a time, without recursion
        if depth > max_depth:
            raise ValueError(f"JSON nested more than {max_depth} levels deep")
        level = [x for item in level for x in (item.values() if isinstance(item, dict) else item)
                 if isinstance(x, (dict, list))]
        depth += 1
    return value


def refuse_past_shape(raw: bytes, max_strings: int, max_items: int, max_containers: int) -> None:
    """ValueError if a JSON text would build more strings, values (the commas between them, outside strings) or
    objects and lists than said: counted before anything is built, linear in time and memory, in C. Quotes are
    counted first; then escaped backslashes, then escaped quotes, blanked, and what lies between the quotes
    left is outside every string. (A regular expression for a string started again at each escaped quote of
    one that never closed: 2 MiB of \\" held a grader for hours.)"""
    if raw.count(b'"') > 2 * max_strings:
        raise ValueError(f"JSON of more than {max_strings} strings")
    bare = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__").split(b'"')[0::2]
    items = sum(part.count(b",") for part in bare)
    containers = sum(part.count(b"{") + part.count(b"[") for part in bare)
    if items > max_items or containers > max_containers:
        raise ValueError(f"JSON of {containers} lists and objects and {items} values "
                         f"(at most {max_containers} and {max_items})")


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a regular file"


__all__ = ["UnsafeFile", "open_dir", "open_regular", "read_bounded", "create_exclusive", "replace_atomically",
           "json_of", "refuse_past_shape"]
