"""The figures the README and the examples' READMEs quote come from docs/results/single_runs.json
(tools/docs_figures.py): a page that drifts from the table, or a table edit not carried to the
pages, fails here."""

import json

from tests.tools._load import load_tool

figures = load_tool("docs_figures")


def test_every_page_matches_the_table():
    assert figures.main(["--check"]) == 0


def test_pages_quote_every_block_kind():
    text = "".join(open(f"{figures.ROOT}/{page}").read() for page in figures.PAGES)
    kinds = {m.group("kind") for m in figures.BLOCK.finditer(text)}
    assert kinds == {"summary", "first-last-5", "first-last-10"}


def test_a_changed_figure_changes_its_blocks(tmp_path):
    runs = figures.load_runs()
    page = open(f"{figures.ROOT}/README.md").read()
    assert figures.rewrite(page, runs) == page
    changed = json.loads(json.dumps(runs))
    changed[0]["reward_last5"] = 0.5
    new = figures.rewrite(page, changed)
    # the run's summary block and its row of the range table both change
    assert "last 5 steps: +0.500" in new and "-> 0.500 |" in new and new != page


def test_unknown_run_is_named():
    try:
        figures.render("summary", "no_such_run", figures.load_runs())
    except ValueError as e:
        assert "no_such_run" in str(e)
    else:
        raise AssertionError("an unknown run id must be refused")
