"""``SGLangEngine`` built as the tests write it: the ``rollout.sglang`` fields as keywords go into
its ``SGLangConfig``; server handles (not URLs) go as ``servers``; every other keyword is the
engine's own (``quantization`` / ``kv_cache_dtype``: the rollout section's defaults unless given)."""

from dataclasses import fields

from hapo_megatron.config import RolloutConfig, SGLangConfig
from hapo_megatron.rollout.sglang.engine import SGLangEngine

SECTION = frozenset(f.name for f in fields(SGLangConfig))


def sglang_engine(**kw) -> SGLangEngine:
    section = {k: kw.pop(k) for k in list(kw) if k in SECTION}
    urls = section.get("server_urls")
    if urls and not all(isinstance(u, str) for u in urls):
        kw["servers"] = section.pop("server_urls")
    kw.setdefault("quantization", RolloutConfig().quantization)
    kw.setdefault("kv_cache_dtype", RolloutConfig().kv_cache_dtype)
    return SGLangEngine(SGLangConfig(**section), **kw)
