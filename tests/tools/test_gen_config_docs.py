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
        for f in dataclasses.fields(cls):
            tp = C._hints(cls)[f.name]
            key = f"{prefix}.{f.name}"
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
