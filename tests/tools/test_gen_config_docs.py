"""docs/configuration.md is generated from the config dataclasses and must be up to date."""

import dataclasses

from tests.tools._load import load_tool

gen = load_tool("gen_config_docs")


def test_committed_config_page_is_up_to_date():
    with open(gen.DEFAULT_OUT, encoding="utf-8") as f:
        committed = f.read()
    assert committed == gen.generate(), (
        "docs/configuration.md is stale: run `python tools/gen_config_docs.py` and commit it")


def test_every_field_and_preset_is_documented():
    import hapo_megatron.config as C
    from hapo_megatron.presets import PRESETS

    text = gen.generate()

    def walk(cls, prefix):
        for name, (tp, _) in C.config_keys(cls).items():
            key = f"{prefix}.{name}"
            assert f"| `{key}` |" in text, key
            if isinstance(tp, type) and issubclass(tp, C._Section):
                walk(tp, key)

    for f in dataclasses.fields(C.HapoConfig):
        walk(C._hints(C.HapoConfig)[f.name], f.name)
    for name in PRESETS:
        assert f"| `{name}` |" in text


def test_helpers():
    from typing import Optional

    assert gen.type_name(Optional[int]) == "int | null"
    assert gen.type_name(list[str]) == "list[str]"
    assert gen.cell("a |\n b") == "a \\| b"
    assert gen.fmt_default(None) == "`null`" and gen.fmt_default([1]) == "`[1]`"


def _slug(title):
    """GitHub's heading anchor: lower case, punctuation dropped, spaces -> '-'."""
    import re

    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_docs_relative_links_resolve():
    import os
    import re

    docs = os.path.dirname(gen.DEFAULT_OUT)
    pages = {f: open(os.path.join(docs, f), encoding="utf-8").read()
             for f in os.listdir(docs) if f.endswith(".md")}
    anchors = {f: {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
               for f, text in pages.items()}
    for name, text in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            page = path or name
            if page.endswith(".md") and "/" not in page:  # a page of docs/: its anchors are checked too
                assert page in pages, f"{name}: broken link {target}"
                assert not anchor or anchor in anchors[page], f"{name}: missing anchor {target}"
            else:
                assert os.path.exists(os.path.join(docs, path)), f"{name}: broken link {target}"
