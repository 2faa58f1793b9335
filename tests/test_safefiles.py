"""hpdl.safefiles: what the grader and the checker's trusted side open in a folder a learner can
write. Each attack class a learner can plant there in place of the file we expect: a symbolic
link (to a file of the instructor's, to /dev/zero), a FIFO, a device, a file too large, a name
taken before we create it."""
from __future__ import annotations

import json
import os
import threading

import pytest

from hpdl import safefiles
from conftest import deep_tree


def test_a_regular_file_is_read_whole_within_its_bound(tmp_path):
    (tmp_path / "f").write_bytes(b"abc" * 10)
    assert safefiles.read_bounded(tmp_path / "f", 30) == b"abc" * 10
    assert safefiles.read_bounded(tmp_path / "f", 100, offset=27) == b"abc"
    fd = safefiles.open_dir(tmp_path)
    try:
        assert safefiles.read_bounded("f", 30, dir_fd=fd) == b"abc" * 10
    finally:
        os.close(fd)


@pytest.mark.parametrize("target", ["/dev/zero", "outside"])
def test_a_symbolic_link_is_never_followed(tmp_path, target):
    secret = tmp_path / "outside"
    secret.write_text("the instructor's file")
    os.symlink(secret if target == "outside" else target, tmp_path / "planted")
    with pytest.raises(safefiles.UnsafeFile, match="symbolic link"):
        safefiles.read_bounded(tmp_path / "planted", 1 << 20)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # nobody writes it: a plain open() would block for ever
    done = []

    def read():
        try:
            safefiles.read_bounded(tmp_path / "fifo", 100)
        except safefiles.UnsafeFile as exc:
            done.append(str(exc))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the reader so the test process can end, then fail
        os.close(os.open(tmp_path / "fifo", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("opening a FIFO blocked")
    assert done and "FIFO" in done[0]


def test_a_device_and_a_folder_are_not_regular_files(tmp_path):
    with pytest.raises(safefiles.UnsafeFile, match="character device"):
        safefiles.read_bounded("/dev/zero", 100)
    with pytest.raises(safefiles.UnsafeFile, match="folder"):
        safefiles.read_bounded(tmp_path, 100)


def test_an_oversized_file_is_refused_or_cut_never_read_whole(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 5000)
    with pytest.raises(safefiles.UnsafeFile, match="more than 4096 bytes"):
        safefiles.read_bounded(tmp_path / "big", 4096)
    assert safefiles.read_bounded(tmp_path / "big", 4096, too_large="cut") == b"x" * 4096


def test_a_file_with_holes_is_not_read_where_only_written_bytes_may_be(tmp_path):
    """A learner's output truncated to 64 MiB takes next to nothing on disk, where its folder's cap
    counts it; the checker's copy of it would take 64 MiB for real. Read only as written: refused."""
    holes = tmp_path / "out-0-0.bin"
    holes.write_bytes(b"x" * 100)
    os.truncate(holes, 64 << 20)
    with pytest.raises(safefiles.UnsafeFile, match="holes"):
        safefiles.read_bounded(holes, 512 << 20, written=True)
    assert len(safefiles.read_bounded(holes, 512 << 20)) == 64 << 20  # as any other file, elsewhere
    dense = tmp_path / "dense"
    dense.write_bytes(b"y" * 300_000)
    assert safefiles.read_bounded(dense, 512 << 20, written=True) == b"y" * 300_000


def test_create_is_exclusive_and_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "bashrc"
    victim.write_text("original")
    os.symlink(victim, tmp_path / "planted.tmp")
    with pytest.raises(FileExistsError):
        safefiles.create_exclusive(tmp_path / "planted.tmp", "echo pwned")
    (tmp_path / "taken").write_text("theirs")
    with pytest.raises(FileExistsError):
        safefiles.create_exclusive(tmp_path / "taken", "ours")
    assert victim.read_text() == "original" and (tmp_path / "taken").read_text() == "theirs"
    safefiles.create_exclusive(tmp_path / "new", b"ours", mode=0o600)
    assert (tmp_path / "new").read_bytes() == b"ours" and (tmp_path / "new").stat().st_mode & 0o077 == 0


def test_replace_swaps_a_planted_link_for_a_file_without_touching_its_target(tmp_path):
    victim = tmp_path / "bashrc"
    victim.write_text("original")
    os.symlink(victim, tmp_path / "answer.json")  # the final name planted as a link
    os.symlink(victim, tmp_path / "answer.json.tmp")  # and the old fixed temporary name
    safefiles.replace_atomically(str(tmp_path / "answer.json"), "{}")
    assert victim.read_text() == "original"
    assert not (tmp_path / "answer.json").is_symlink() and (tmp_path / "answer.json").read_text() == "{}"
    assert {p.name for p in tmp_path.iterdir()} == {"bashrc", "answer.json", "answer.json.tmp"}


def test_a_folder_renamed_away_and_replaced_by_a_link_is_not_followed(tmp_path):
    (tmp_path / "inbox").mkdir()
    (tmp_path / "home").mkdir()
    fd = safefiles.open_dir(tmp_path / "inbox")
    try:
        os.rename(tmp_path / "inbox", tmp_path / "moved")
        os.symlink(tmp_path / "home", tmp_path / "inbox")
        safefiles.replace_atomically("resp.json", "{}", dir_fd=fd)
        assert (tmp_path / "moved" / "resp.json").exists() and not list((tmp_path / "home").iterdir())
        with pytest.raises(safefiles.UnsafeFile, match="not a folder"):
            safefiles.open_dir(tmp_path / "inbox")
    finally:
        os.close(fd)


# a learner's process closes folders of its own to everyone (chmod 000): what they hold is still
# counted against its folder's cap, and the folder is still removed; a folder above is never opened
CLOSED_TREE = """
import os, sys
sys.path.insert(0, sys.argv[1])
from hpdl import safefiles
from hpdl.checker import sandbox
top = sys.argv[2]
deep = "/".join("abcdefgh")  # eight folders, each closed below the next
for d in (deep, "d"):
    os.makedirs(os.path.join(top, "x", d))
for f in (deep + "/f", "a/b/g", "d/h"):
    with open(os.path.join(top, "x", f), "wb") as out:
        out.write(b"x" * (1 << 20))
for i in range(len(deep), 0, -2):
    os.chmod(os.path.join(top, "x", deep[:i]), 0o000 if i > 1 else 0o500)
for d, mode in (("d", 0o000), ("", 0o000)):
    os.chmod(os.path.join(top, "x", d), mode)
print("counted", sandbox.disk_usage(os.path.join(top, "x"), 100) >= 3 << 20)
os.chmod(os.path.join(top, "x"), 0o000)
safefiles.remove_tree(os.path.join(top, "x"))
print("left", os.path.lexists(os.path.join(top, "x")), "top", oct(os.stat(top).st_mode & 0o777))
"""


def test_a_folder_closed_to_its_owner_is_counted_and_removed():
    import shutil
    import subprocess

    python = "/usr/bin/python3"  # one every account may run (hpdl's two modules here need no package)
    if os.geteuid() != 0 or not shutil.which("runuser") or not os.path.exists(python):
        pytest.skip("runs the learner's side as another account (root reads any folder), with /usr/bin/python3")
    import tempfile

    top = tempfile.mkdtemp(dir="/tmp")  # where another account may enter (pytest's folder is 0700)
    os.chmod(top, 0o755)
    shutil.chown(top, "nobody")
    root = os.path.dirname(os.path.dirname(safefiles.__file__))
    try:
        done = subprocess.run(["runuser", "-u", "nobody", "--", python, "-c", CLOSED_TREE, root, top],
                              capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        shutil.rmtree(top, ignore_errors=True)  # as root: whatever the modes
    assert done.stdout.split() == ["counted", "True", "left", "False", "top", "0o755"], done.stdout + done.stderr


def test_json_nested_too_deep_is_refused_as_bad_json_not_a_crash():
    """Python's json raises RecursionError (not ValueError) past ~1000 levels, from a 2 KB text; the
    grader, the checker's trusted side and the hang report catch ValueError for a learner's bad file."""
    deep = safefiles.JSON_DEPTH
    assert safefiles.json_of("[" * deep + "]" * deep) == eval("[" * deep + "]" * deep)
    assert safefiles.json_of(b'{"cells": [], "n": 5}') == {"cells": [], "n": 5} and safefiles.json_of("7") == 7
    for text in ("[" * (deep + 1) + "]" * (deep + 1), '{"a": ' * 100_000 + "1" + "}" * 100_000, b"\xff", "{"):
        with pytest.raises(ValueError):
            safefiles.json_of(text)


def test_json_of_millions_of_objects_is_refused_unparsed():
    """A notebook of 22 million empty cells, under the 64 MiB a notebook may take, cost the grader 1.9 GB
    and 20 s of its loop, once for each of the four times it read it: refused before parsing."""
    many = b'{"cells": [' + b"{}," * (safefiles.JSON_CONTAINERS + 1) + b"{}]}"
    with pytest.raises(ValueError, match="lists and objects"):
        safefiles.json_of(many)
    assert len(safefiles.json_of(b'{"cells": [' + b"{}," * 999 + b"{}]}")["cells"]) == 1000


def test_json_of_millions_of_values_or_strings_is_refused_unparsed():
    """A 64 MiB notebook of one flat list of 16 million numbers (its brackets few) took the grader 1.2 GB and
    seconds of its loop, each of the times it read it; as many short strings, more. Refused from its shape,
    counted outside strings: a notebook whose text holds commas, brackets and escaped quotes is read."""
    import tracemalloc

    numbers = b'{"cells": [], "x": [' + b"1e9," * (safefiles.JSON_ITEMS + 1) + b"0]}"
    strings = b'{"cells": [], "x": [' + b'"ab",' * safefiles.JSON_STRINGS + b'"ab"]}'
    for text in (numbers, strings):
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match="values|strings"):
                safefiles.json_of(text)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * len(text), (len(text), peak)
    line = 'print([1, 2], {"a": [3]}, \'\\"[{,\')\n'
    honest = {"cells": [{"cell_type": "code", "source": [line] * 100_000, "outputs": [], "metadata": {}}]}
    assert safefiles.json_of(json.dumps(honest)) == honest  # 500,000 commas and brackets, all in strings


def test_a_tree_thousands_of_folders_deep_is_removed(tmp_path):
    """shutil.rmtree recursed once per level: a learner's folder deeper than the recursion limit
    raised RecursionError out of the grader's cleanup (the batch ended). Deeper than PATH_MAX too,
    a folder closed to its owner inside, a link to a folder outside that must be left whole."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    work = tmp_path / "work"
    first = deep_tree(work, 2500, name="d" * 8)  # 2500 x 9 characters: over PATH_MAX (4096)
    os.symlink(outside, os.path.join(first, "link"))
    os.makedirs(work / "closed" / "inner")
    os.chmod(work / "closed", 0o000)
    safefiles.remove_tree(work)  # 2500 levels: more than the descriptors a process may hold (1024)
    assert not work.exists() and (outside / "keep").read_text() == "mine"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".hpdl-removing")]
