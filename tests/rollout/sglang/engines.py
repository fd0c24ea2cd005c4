"""``SGLangEngine`` built as the tests write it: the ``rollout.sglang`` fields as keywords go into
its ``SGLangConfig``; server handles (not URLs) go as ``servers``; every other keyword is the
engine's own."""

from dataclasses import fields

from hapo_megatron.config import SGLangConfig
from hapo_megatron.rollout.sglang.engine import SGLangEngine

SECTION = frozenset(f.name for f in fields(SGLangConfig))


def sglang_engine(**kw) -> SGLangEngine:
    section = {k: kw.pop(k) for k in list(kw) if k in SECTION}
    urls = section.get("server_urls")
    if urls and not all(isinstance(u, str) for u in urls):
        kw["servers"] = section.pop("server_urls")
    return SGLangEngine(SGLangConfig(**section), **kw)
