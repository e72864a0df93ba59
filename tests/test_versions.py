"""The tested range of accelerate and transformers: requirements.txt and the check say the same, and a
release outside it is refused in one line that names the range and the reason."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, run_script

from fsdp2bench import versions
from fsdp2bench.cli import UserError


def test_requirements_state_the_tested_range():
    text = (ROOT / "requirements.txt").read_text()
    for library, (lowest, newest, _) in versions.TESTED.items():
        assert re.search(rf"^{library}>={re.escape(lowest)},<={re.escape(newest)}$", text, re.M), library


def test_the_installed_releases_are_in_the_range():
    versions.check_releases()


@pytest.mark.parametrize("library, installed, words", [
    ("accelerate", "1.10.1", "accelerate 1.10.1 is outside the tested range 1.11.0 to 1.15.0 (1.10 reduce-scatters"),
    ("transformers", "5.0.0", "transformers 5.0.0 is outside the tested range 5.1.0 to 5.24.0 (5.0.0 builds"),
    ("transformers", "5.25.0.dev0", "(5.24.0 is the newest the benchmark was tested with)"),
    ("transformers", "6.0.0", "(5.24.0 is the newest the benchmark was tested with)"),
])
def test_a_release_outside_the_range_is_refused_in_one_line(monkeypatch, library, installed, words):
    real = versions.version
    monkeypatch.setattr(versions, "version", lambda name: installed if name == library else real(name))
    with pytest.raises(UserError, match=re.escape(words)):
        versions.check_releases()
    monkeypatch.setenv(versions.ANY_RELEASE, "1")
    versions.check_releases()  # the way out, said in the line


def test_release_numbers_compare_as_releases():
    assert versions._release("5.17.0") < versions._release("5.24.0") < versions._release("5.100.1")
    assert versions._release("1.15.0rc1") == (1, 15, 0) and versions._release("2.13.0+cpu") == (2, 13, 0)


def test_a_launch_with_an_untested_release_ends_in_one_line(tmp_path):
    """The check runs first: a fake accelerate of version 0.1.0 earlier on the path is refused by name."""
    fake = tmp_path / "site" / "accelerate-0.1.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: accelerate\nVersion: 0.1.0\n")
    proc = run_script(["main.py", "--device", "cpu", "--output_dir", str(tmp_path / "out")], nproc=None,
                      PYTHONPATH=str(tmp_path / "site"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: accelerate 0.1.0 is outside the tested range 1.11.0 to 1.15.0 (1.10 reduce-scatters every microbatch "
        "under FSDP2 whatever sync_each_batch says: its accumulate() leaves gradient sync on); pip install -r "
        "requirements.txt, or set FSDP2_BENCH_ANY_RELEASE=1 to run with it anyway"]
