"""The README and docs/*.md: every relative link resolves, and the README agrees with the CLI.

  * every relative link in README.md and docs/*.md names a file or folder that exists inside
    the repository (an anchor, `#section`, must name a heading of the target Markdown file,
    slugged as GitHub slugs it); no link and no path leaves the repository (no `../shared`);
  * every measured number in the README (a percentage or an "Nx" ratio) sits on a line that
    links a page under docs/results/;
  * every `--flag` the README names is a flag of `thinwire train` or `thinwire compare`, and
    every optimizer in a README `--optimizers` / `--optimizer` value is one the CLI accepts;
  * the two commands CI runs (.ci/run) appear in the README exactly.
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
CI_COMMANDS = ['pip install -c constraints.txt -e . && thinwire compare',
               'pip install -c constraints.txt -e ".[test]" && python -m pytest']


def prose(text: str) -> str:
    """The text outside fenced code blocks (links in code are not links)."""
    out, fence = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            out.append("")
            continue
        out.append("" if fence else line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).split("\n"):
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def test_the_pages_exist():
    names = {p.name for p in PAGES}
    for page in ("README.md", "optimizers.md", "harness.md", "two-tiers.md", "checkpoints-and-elastic.md",
                 "trainers.md", "wire-format.md", "coming-from.md", "design.md"):
        assert page in names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):          # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if ROOT not in resolved.parents and resolved != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not resolved.exists():
            bad.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            bad.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_points_outside_the_repository(page):
    assert "../shared" not in page.read_text()


def test_every_measured_number_in_the_readme_links_its_results_page():
    measured = re.compile(r"\d(?:[\d.,]*\d)?(?: ?%|x\b)")
    bad = [line for line in prose((ROOT / "README.md").read_text()).split("\n")
           if measured.search(line) and "(docs/results/" not in line]
    assert not bad, "numbers without their results page:\n" + "\n".join(bad)


@lru_cache(maxsize=None)
def cli_help(command: str) -> str:
    out = subprocess.run([sys.executable, "-c", "import sys; from thinwire.__main__ import main; "
                          f"sys.argv = ['thinwire', '{command}', '--help']; main()"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_readme_names_only_flags_and_optimizers_the_cli_has():
    readme = (ROOT / "README.md").read_text()
    helps = cli_help("train") + cli_help("compare")
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", helps))
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", readme))
    torch_flags = {"--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--standalone", "--max-restarts"}
    assert named - torch_flags <= flags, f"not flags of thinwire train/compare: {sorted(named - torch_flags - flags)}"
    # argparse wraps help lines at hyphens too ("sparseloco-" / "delayed"): join those first
    text = re.sub(r"-\s+", "-", " ".join(cli_help("compare").split()))
    choices = re.search(r"comma-separated, from: (.*?) \(default", text)
    accepted = {name.strip() for name in choices.group(1).split(",")}
    for value in re.findall(r"--optimizers? ([\w,-]+)", readme):
        assert set(value.split(",")) <= accepted, value
    for preset in re.findall(r"--preset ([\w|]+)", readme):
        for name in preset.split("|"):
            assert name in cli_help("compare"), name


def test_the_readme_holds_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for command in CI_COMMANDS:
        assert command in readme
        assert command.split(" && ")[0] in ci
