"""hpdl.safefiles: what the grader and the checker's trusted side open in a folder a learner can
write. Each attack class a learner can plant there in place of the file we expect: a symbolic
link (to a file of the instructor's, to /dev/zero), a FIFO, a device, a file too large, a name
taken before we create it."""
from __future__ import annotations

import os
import threading

import pytest

from hpdl import safefiles


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
