"""The README is one screen and every link in it and in docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def test_the_readme_is_one_screen_and_links_every_docs_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 10 * 1024
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in text, page.name


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or (anchor and resolved.is_file() and anchor not in anchors(resolved)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_each_docs_page_starts_with_the_question_it_answers():
    for page in (ROOT / "docs").glob("*.md"):
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# ") and lines[2].startswith("*") and lines[2].rstrip().endswith("?*"), page.name


# The pages whose commands a newcomer copies: the README and the page that holds its figures.
COMMAND_PAGES = [ROOT / "README.md", ROOT / "docs" / "results-overview.md", ROOT / "docs" / "plan.md",
                 ROOT / "docs" / "fine-tuning.md"]
SCRIPT = re.compile(r"\w+\.py")
LAUNCHERS = ("python3", "python", "torchrun", "accelerate")


def code_of(page: Path) -> list[str]:
    """Every command a page shows: the lines of its indented and fenced code blocks (a line ended by a backslash
    joined to the next, a shell comment left out), and each inline code span that starts with a launcher or with a
    script and its options (`plan.py --find layout ...`)."""
    found, prose, fenced = [], [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            code = re.sub(r"\s#.*", "", line).rstrip()
            if found and found[-1].endswith("\\"):
                found[-1] = found[-1][:-1] + " " + code.strip()
            else:
                found.append(code)
        else:
            prose.append(line)
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):  # a span may run over a line break
        words = span.split()
        if words and (words[0] in LAUNCHERS or (SCRIPT.fullmatch(words[0]) and len(words) > 1)):
            found.append(" ".join(words))
    return found


def command_lines(page: Path) -> list[tuple[str, list[str]]]:
    """(script, its arguments) of every command on the page that runs one of the scripts."""
    found = []
    for line in code_of(page):
        for command in line.split("&&"):
            words = command.split()
            script = next((w for w in words if SCRIPT.fullmatch(w)), None)
            if script:
                found.append((script, words[words.index(script) + 1:]))
    return found


def readme_command_lines() -> list[tuple[str, list[str]]]:
    return command_lines(ROOT / "README.md")


def test_code_spans_and_fenced_blocks_are_read_as_commands(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `python3 plan.py\n--world_size 8` or `plan.py --find layout`, not `matrix.py`.\n\n"
                    "```\ntorchrun --nproc_per_node 2 main.py --max_steps 3\n```\n\n"
                    "    python3 visualize.py --dir out\n\n"
                    "    python3 plan.py --peft lora \\\n        --world_size 2  # N\n")
    assert sorted(command_lines(page)) == [("main.py", ["--max_steps", "3"]), ("plan.py", ["--find", "layout"]),
                                           ("plan.py", ["--peft", "lora", "--world_size", "2"]),
                                           ("plan.py", ["--world_size", "8"]), ("visualize.py", ["--dir", "out"])]


def test_every_command_line_of_the_readme_is_one_its_script_takes():
    """Each option and value as its script's parser reads it (matrix.py's others as main.py's), on the README, on
    the page of its figures and on the planner's and fine-tuning's pages; among them the Trainer's loop and liger's
    loss, which a newcomer looks for."""
    import loading
    import matrix
    import plan
    import visualize
    from fsdp2bench.run import arguments

    commands = readme_command_lines()
    assert {script for script, _ in commands} >= {"main.py", "visualize.py", "plan.py", "matrix.py"}
    for script, argv in [command for page in COMMAND_PAGES for command in command_lines(page)]:
        if script == "matrix.py":
            _, forwarded = matrix.parse_args(argv)
            arguments.parse_args(forwarded)
        else:
            {"main.py": arguments, "plan.py": plan, "visualize.py": visualize, "loading.py": loading}[script] \
                .parse_args(argv)
    main_lines = [" ".join(argv) for script, argv in commands if script == "main.py"]
    assert any("--loop trainer" in line and "--loss liger" in line for line in main_lines), main_lines


def test_every_plan_run_kept_in_results_is_ranked_in_its_readme():
    """results/h200/plan_1.5b holds a folder per plan.py run, named by the commit that ran it: its README's first
    table says which to read first and where each of the others stands."""
    folder = ROOT / "results" / "h200" / "plan_1.5b"
    index = (folder / "README.md").read_text().split("\n## ")[1]
    assert index.startswith("Which folder to read")
    assert "**read first**" in index
    for run in (p for p in folder.iterdir() if p.is_dir()):
        assert f"`{run.name}/`" in index, run.name
