"""The tested range of accelerate and transformers: requirements.txt and the check say the same, and a
release outside it is refused in one line that names the range and the reason."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, run_script

from fsdp2bench.cli import UserError
from fsdp2bench.run import versions


def test_requirements_state_the_tested_range():
    text = (ROOT / "requirements.txt").read_text()
    for library, (lowest, newest, _) in versions.TESTED.items():
        assert re.search(rf"^{library}>={re.escape(lowest)},<={re.escape(newest)}$", text, re.M), library


def test_the_installed_releases_are_in_the_range():
    versions.check_releases()


@pytest.mark.parametrize("library, installed, words", [
    ("accelerate", "1.10.1", "accelerate 1.10.1 at /copy/accelerate is outside the tested range 1.11.0 to 1.15.0 (1.10 "
                             "reduce-scatters"),
    ("transformers", "5.0.0", "transformers 5.0.0 at /copy/transformers is outside the tested range 5.1.0 to 5.24.0 "
                              "(5.0.0 builds"),
    ("transformers", "5.25.0.dev0", "(5.24.0 is the newest the benchmark was tested with)"),
    ("transformers", "6.0.0", "(5.24.0 is the newest the benchmark was tested with)"),
])
def test_a_release_outside_the_range_is_refused_in_one_line(monkeypatch, library, installed, words):
    real = versions.imported
    monkeypatch.setattr(versions, "imported",
                        lambda name: (installed, f"/copy/{name}") if name == library else real(name))
    with pytest.raises(UserError, match=re.escape(words)):
        versions.check_releases()
    monkeypatch.setenv(versions.ANY_RELEASE, "1")
    versions.check_releases()  # the way out, said in the line


def test_release_numbers_compare_as_releases():
    assert versions._release("5.17.0") < versions._release("5.24.0") < versions._release("5.100.1")
    assert versions._release("1.15.0rc1") == (1, 15, 0) and versions._release("2.13.0+cpu") == (2, 13, 0)


def test_the_release_checked_is_the_imported_modules_not_the_metadatas(tmp_path, monkeypatch):
    """Metadata first on the path that names another release than the module imported is not what runs."""
    for library in versions.TESTED:
        fake = tmp_path / f"{library}-0.1.0.dist-info"
        fake.mkdir()
        (fake / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {library}\nVersion: 0.1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    versions.check_releases()
    import accelerate
    import transformers
    assert [versions.imported(name)[0] for name in versions.TESTED] == [accelerate.__version__,
                                                                        transformers.__version__]


def copy_on_the_path(site, library: str, init: str) -> str:
    """A package ``library`` under ``site`` (first on PYTHONPATH in the launch) whose __init__ is ``init``."""
    package = site / library
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    return str(package)


def test_a_launch_with_an_untested_release_on_the_path_ends_in_one_line(tmp_path):
    """A copy of accelerate that says 1.5.0 first on the path (pip's metadata still names the installed one): the
    check reads the module that is imported, and names where it is."""
    where = copy_on_the_path(tmp_path / "site", "accelerate", '__version__ = "1.5.0"\n\n\nclass Accelerator:\n'
                                                              '    pass\n')
    proc = run_script(["main.py", "--device", "cpu", "--output_dir", str(tmp_path / "out")], nproc=None,
                      PYTHONPATH=str(tmp_path / "site"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: accelerate 1.5.0 at {where} is outside the tested range 1.11.0 to 1.15.0 (1.10 reduce-scatters every "
        "microbatch under FSDP2 whatever sync_each_batch says: its accumulate() leaves gradient sync on); pip install "
        "-r requirements.txt, or set FSDP2_BENCH_ANY_RELEASE=1 to run with it anyway"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, library, init, words, env", [
    ("main.py", "transformers", "raise ImportError('this copy is broken')\n",
     "cannot be imported (ImportError: this copy is broken)", {}),
    ("plan.py", "transformers", "def broken(:\n", "cannot be imported (SyntaxError: ", {}),
    ("loading.py", "transformers", "import no_such_module_here\n",
     "cannot be imported (ModuleNotFoundError: No module named 'no_such_module_here')", {}),
    ("main.py", "accelerate", "class Accelerator:\n    pass\n", "gives no release (__version__ is None)",
     {versions.ANY_RELEASE: "1"}),
    ("main.py", "transformers", "__version__ = '5.17.0'\n", "cannot be imported (AttributeError: ", {}),
])
def test_a_library_that_fails_to_import_is_one_line_naming_it_and_its_path(tmp_path, script, library, init, words,
                                                                           env):
    """Any copy of a library that cannot be imported, or gives no release, whatever the entry script (and even
    where any release is allowed): one line naming the library and where it is, never a traceback."""
    where = copy_on_the_path(tmp_path / "site", library, init)
    proc = run_script([script, "--device", "cpu", "--model", "tiny", "--output_dir", str(tmp_path / "out")],
                      nproc=None, PYTHONPATH=str(tmp_path / "site"), **env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {library} at {where} {words}"), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "out").exists()
