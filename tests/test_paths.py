"""Every path option of every script, given each kind of path: the error line says what is there."""

from __future__ import annotations

import os

import pytest

import loading
import matrix
import plan
import speed
import visualize
from fsdp2bench.cli import UserError
from fsdp2bench.run import arguments

MISSING, BROKEN_LINK, LOOP, FILE, DIRECTORY = "missing", "a broken link", "a link loop", "a file", "a directory"
LOOP_WORDS = "a symbolic link loop"  # not "a broken symbolic link": nothing is missing
# What the error line says of each kind where the option reads a directory or a file.
READ = {"directory": {MISSING: "no such file or directory", BROKEN_LINK: "a broken symbolic link", LOOP: LOOP_WORDS,
                      FILE: "a file, not a directory"},
        "file": {MISSING: "no such file or directory", BROKEN_LINK: "a broken symbolic link", LOOP: LOOP_WORDS,
                 DIRECTORY: "a directory, not a file"}}
# Where it writes a directory (created if missing) or a file.
WRITE = {"directory": {BROKEN_LINK: "a broken symbolic link", LOOP: LOOP_WORDS, FILE: "a file, not a directory"},
         "file": {BROKEN_LINK: "a broken symbolic link", LOOP: LOOP_WORDS,
                  DIRECTORY: "a directory; the script writes a file there"}}


def matrix_validate(argv: list[str]) -> None:
    matrix.check(*matrix.parse_args(argv))


# (script, how it checks a command line, flag, what it reads or writes, the rest of a valid command line)
OPTIONS = [
    ("main.py", arguments.validate, "--dataset", READ["file"], ["--device", "cpu"]),
    ("main.py", arguments.validate, "--tokenizer", READ["directory"], ["--device", "cpu"]),
    ("main.py", arguments.validate, "--model", READ["directory"], ["--device", "cpu"]),
    ("main.py", arguments.validate, "--output_dir", WRITE["directory"], ["--device", "cpu"]),
    ("loading.py", loading.validate, "--checkpoint", READ["directory"], ["--device", "cpu"]),
    ("loading.py", loading.validate, "--model", READ["directory"], ["--device", "cpu"]),
    ("loading.py", loading.validate, "--output_dir", WRITE["directory"], ["--device", "cpu"]),
    ("speed.py", speed.validate, "--baseline", READ["directory"], ["--", "--device", "cpu"]),
    ("speed.py", speed.validate, "--json", WRITE["file"], ["--", "--device", "cpu"]),
    ("visualize.py", visualize.validate, "--dir", READ["directory"], []),
    ("matrix.py", matrix_validate, "--output_dir", WRITE["directory"], ["--device", "cpu"]),
    ("plan.py", plan.validate, "--model", READ["directory"], ["--device", "cpu"]),
    ("plan.py", plan.validate, "--output_dir", WRITE["directory"], ["--device", "cpu"]),
]
CASES = [(script, check, flag, kind, words, rest) for script, check, flag, said, rest in OPTIONS
         for kind, words in said.items()]


def make(tmp_path, kind: str) -> str:
    path = tmp_path / "given path"
    if kind == BROKEN_LINK:
        os.symlink(tmp_path / "gone", path)
    elif kind == LOOP:  # two links, each pointing at the other
        os.symlink(tmp_path / "other link", path)
        os.symlink(path, tmp_path / "other link")
    elif kind == FILE:
        path.write_text("some text")
    elif kind == DIRECTORY:
        path.mkdir()
    return str(path)


@pytest.mark.parametrize("script, check, flag, kind, words, rest", CASES,
                         ids=[f"{c[0]} {c[2]} {c[3]}" for c in CASES])
def test_a_path_option_says_what_the_path_is(script, check, flag, kind, words, rest, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the scripts' default output directories land here
    path = make(tmp_path, kind)
    with pytest.raises(UserError) as refused:
        check([flag, path, *(["--output_dir", str(tmp_path / "out")] if flag != "--output_dir" and script not in
                             ("visualize.py", "speed.py") else []), *rest])
    assert str(refused.value).startswith(f"{flag} {path}: ") and words in str(refused.value), str(refused.value)


WRITTEN = [(script, check, flag, rest) for script, check, flag, said, rest in OPTIONS if said in WRITE.values()] + \
    [("visualize.py", visualize.validate, "--dir", [])]


@pytest.mark.parametrize("script, check, flag, rest", WRITTEN, ids=[f"{w[0]} {w[2]}" for w in WRITTEN])
def test_a_place_no_file_can_be_made_in_is_refused_before_anything_is_written(script, check, flag, rest, tmp_path,
                                                                              monkeypatch):
    """A read-only mount or an immutable directory (as root too, whom ``os.access`` lets through): every script
    that writes there says so in one line, before it writes or draws anything."""
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.chdir(tmp_path)
    where = tmp_path / "given path"
    where.mkdir()
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    path = str(where / "speed.json") if flag == "--json" else str(where)
    with pytest.raises(UserError) as refused:
        check([flag, path, *rest])
    assert "cannot write" in str(refused.value) and "no file can be made in it: Read-only file system" in \
        str(refused.value), str(refused.value)
    assert str(refused.value).startswith(f"{flag} {path if flag != '--json' else where}"), str(refused.value)
    assert os.listdir(where) == []


def test_a_write_that_fails_once_a_script_runs_is_one_line_and_exit_1(tmp_path):
    """A full disk or a directory gone while drawing or training: the file named, no traceback."""
    from conftest import run_script

    code = ("from fsdp2bench.cli import exit_with\n"
            "def run():\n"
            f"    raise OSError(28, 'No space left on device', {str(tmp_path / 'loss.png')!r})\n"
            "exit_with(run)\n")
    proc = run_script(["-c", code], nproc=None)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == f"error: cannot write {tmp_path / 'loss.png'} (No space left on device)\n"
