"""The package's wings keep their order: every import of the project reads down a layer or within its own wing, no
entry script imports another, and every module path written as text (a launch's ``-m``, the fork server's preload,
a docs page) names a module that is there."""

from __future__ import annotations

import ast
import importlib.util
import re

import pytest
from conftest import ROOT

# Bottom to top. The exhibit files sit where their imports put them: measure.py (the tracker) beside the names it
# uses, utils.py (the four variants) above the processes whose helpers they call and below the training that runs them.
LAYERS = [
    ("fsdp2bench.names", "fsdp2bench.cli", "fsdp2bench.files", "measure"),
    ("fsdp2bench.options",),
    ("fsdp2bench.memory",),
    ("fsdp2bench.processes",),
    ("utils",),
    ("fsdp2bench.train",),
    ("fsdp2bench.report",),
    ("fsdp2bench.loading",),
    ("fsdp2bench.run",),
    ("fsdp2bench.plan",),
]
ENTRY_SCRIPTS = {"main", "plan", "matrix", "speed", "loading", "visualize"}
# Paths kept on purpose: speed.py looks for the launcher of an older tree where that tree kept it.
OLDER_TREES = {"fsdp2bench/torchrun.py", "fsdp2bench.torchrun"}


def project_modules() -> dict[str, object]:
    """Every project module by its dotted name: the package's and the top-level scripts."""
    found = {}
    for path in [*ROOT.glob("fsdp2bench/**/*.py"), *ROOT.glob("*.py"), *ROOT.glob("examples/*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def imports_of(path, modules) -> list[tuple[int, str]]:
    """(line, module) of every project import in ``path``, those inside functions and TYPE_CHECKING included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                target = full if full in modules else node.module
                if target in modules:
                    found.append((node.lineno, target))
    return found


def layer_of(module: str) -> int | None:
    """The layer of a module (its wing's), None for an entry script or an example (above every layer)."""
    for index, wing in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in wing):
            return index
    return None


def test_every_module_of_the_package_is_in_a_wing():
    modules = project_modules()
    unplaced = [m for m in modules if m.startswith("fsdp2bench.") and layer_of(m) is None]
    assert not unplaced, unplaced
    loose = [m for m in modules if m.count(".") == 1 and m.startswith("fsdp2bench.")
             and not ROOT.joinpath(*m.split(".")).is_dir() and m not in LAYERS[0]]
    assert not loose, f"flat modules outside a wing: {loose}"


def test_no_import_runs_up_a_layer_and_no_entry_script_imports_another():
    modules = project_modules()
    wrong = []
    for name, path in modules.items():
        mine = layer_of(name)
        for line, target in imports_of(path, modules):
            theirs = layer_of(target)
            if target in ENTRY_SCRIPTS or name.startswith("examples.") and target in ENTRY_SCRIPTS:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the entry script {target}")
            elif mine is not None and (theirs is None or theirs > mine):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({name}, layer {mine}) imports {target} "
                             f"(layer {theirs})")
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_fails_on_an_import_that_runs_up(tmp_path):
    """The check above can fail: a memory module that imported the training loop would be named."""
    path = tmp_path / "estimate.py"
    path.write_text("from fsdp2bench.train.runner import TrainConfig\n")
    modules = {**project_modules(), "fsdp2bench.memory.estimate": path}
    (line, target), = imports_of(path, modules)
    assert layer_of(target) > layer_of("fsdp2bench.memory.estimate")


MODULE_TEXT = re.compile(r"(?<![\w./-])fsdp2bench(?:\.[a-z_]+)+")
PATH_TEXT = re.compile(r"(?<![\w./-])fsdp2bench/[\w/]+\.py")
JOINED_PATH = re.compile(r'"fsdp2bench"((?:\s*[/,]\s*"[\w.]+")+)')  # a path joined of parts
TEXT_FILES = [*ROOT.glob("*.py"), *ROOT.glob("fsdp2bench/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("docs/*.md"),
              ROOT / "README.md"]


def names_a_module(dotted: str) -> bool:
    """A module, or an attribute of one (``fsdp2bench.report.plots.load_traces``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:cut])) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


@pytest.mark.parametrize("path", TEXT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_path_written_as_text_is_there(path):
    text = path.read_text()
    dotted = {m for m in MODULE_TEXT.findall(text) if m not in OLDER_TREES}
    missing = [m for m in sorted(dotted) if not names_a_module(m)]
    files = {m for m in PATH_TEXT.findall(text) if m not in OLDER_TREES}
    files |= {"/".join(["fsdp2bench", *re.findall(r'"([\w.]+)"', parts)]) for parts in JOINED_PATH.findall(text)}
    files = {f for f in files if f.endswith(".py") and f not in OLDER_TREES}
    missing += [f for f in sorted(files) if not (ROOT / f).is_file()]
    assert not missing, missing


def test_the_fork_servers_preload_and_the_launch_modules_import():
    from fsdp2bench.processes.starting import server_preload
    from fsdp2bench.report.matrix import launch_command

    for module in server_preload():
        assert importlib.util.find_spec(module) is not None, module
    command = launch_command(2, ["--model", "tiny"])
    assert importlib.util.find_spec(command[command.index("-m") + 1]) is not None
