"""The README and the docs/ pages read as written and their code runs:
every Python block is marked either ``<!-- runs in tests/test_docs.py -->``
(run here, a page's blocks in order in one fresh kernel) or ``<!-- needs a
cluster: ... -->`` (its cluster's own tests cover that call); every link
to a file in the repository finds it; the README stays a five-minute read
(at most 300 lines) that starts with its title, one sentence and the two
set-up commands."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import Kernel

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README] + sorted(p for p in (ROOT / "docs").rglob("*.md"))
MARK = "<!-- runs in tests/test_docs.py -->"
CLUSTER = "<!-- needs a cluster: "
BLOCK = re.compile(r"(?:^|\n)( *)(<!--[^\n]*-->\n *)?```python\n(.*?)```", re.S)

pytestmark = pytest.mark.timeout(300)


def marked_blocks(page: Path) -> list[str]:
    return [code for _, mark, code in BLOCK.findall(page.read_text()) if mark and mark.strip() == MARK]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_python_block_runs_here_or_needs_a_cluster():
    unmarked = [f"{_name(page)}: {code[:60]!r}" for page in PAGES for _, mark, code in BLOCK.findall(page.read_text())
                if not mark or not (mark.strip() == MARK or mark.strip().startswith(CLUSTER))]
    assert unmarked == []


def test_every_link_to_a_file_finds_it():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and "://" not in path and not (page.parent / path).exists():
                broken.append(f"{_name(page)}: {target}")
    assert broken == []


def test_the_readme_is_a_short_read_that_starts_with_the_set_up():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    title, sentence, block = text.split("\n\n")[:3]
    assert title == "# nblaunch" and sentence.count(".") == 1 and "\n" not in sentence
    assert block.startswith("```bash\nbash .ci/setup demo && .venv/bin/python -m nblaunch.demo")
    assert "\nbash .ci/setup && .venv/bin/python -m pytest" in block
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", text))
    guide = {f"docs/guide/{p.name}" for p in (ROOT / "docs" / "guide").glob("*.md")}
    assert guide <= linked, guide - linked  # one paragraph per capability, linking to its page


@pytest.mark.parametrize("page", [p for p in PAGES if marked_blocks(p)], ids=_name)
def test_a_pages_code_runs_in_a_fresh_kernel(page):
    k = Kernel()
    try:
        for block in marked_blocks(page):
            reply = k.execute(block, timeout=240)
            assert reply.error is None, f"{block}\n-> {reply.error.get('ename')}: {reply.error.get('evalue')}"
        if page == README:
            results = k.execute("print(results)").stdout
            assert results.strip() == "[0.6000000238418579, 0.6000000238418579, 0.6000000238418579, 0.6000000238418579]"
    finally:
        k.shutdown()


def test_the_readme_demo_trains_two_ranks_with_live_progress():
    """The README's first command (after its set-up): a real 2-rank CPU training."""
    import subprocess
    import sys

    assert "-m nblaunch.demo" in README.read_text().split("\n## ")[0]
    out = subprocess.run([sys.executable, "-m", "nblaunch.demo", "--epochs", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[nblaunch] starting 2 ranks" in out.stdout
    assert "[rank 0] epoch 2/2: loss" in out.stdout
    assert re.search(r"\[nblaunch\] finished in [\d.]+ s \| rank 0 finished epoch 2/2", out.stdout), out.stdout[-2000:]
    assert "final loss per rank: [" in out.stdout
