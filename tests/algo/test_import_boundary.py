"""hapo_megatron.algo must import with torch only: no megatron, transformers, sglang, and it must
not use torch.distributed."""

import ast
import pathlib
import subprocess
import sys

import hapo_megatron.algo as algo

ALGO_DIR = pathlib.Path(algo.__file__).parent

PROBE = r"""
import sys
for name in ("megatron", "megatron.core", "transformers", "sglang", "vllm"):
    sys.modules[name] = None  # any import of these now raises ImportError
import hapo_megatron.algo as algo
import torch
stats = algo.compute_entropy_stats(torch.rand(3, 4), torch.ones(3, 4), algo.PolicyLossConfig().entropy_pivot)
algo.hapo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3),
                      cfg=algo.PolicyLossConfig(adaptive_clip=False, adaptive_advantage=False))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "transformers", "sglang", "vllm")
               and sys.modules[m] is not None)
print("HEAVY", heavy)
"""


def test_algo_imports_without_heavy_packages():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "HEAVY []" in res.stdout


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_algo_source_does_not_use_torch_distributed_or_heavy_imports():
    """Static check on the code (docstrings may mention the names): imports and attribute uses."""
    heavy = ("megatron", "transformers", "sglang", "vllm", "torch.distributed")
    files = sorted(ALGO_DIR.glob("*.py"))
    assert len(files) >= 7
    for f in files:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [_dotted(node)]
            elif isinstance(node, ast.Name) and node.id == "dist":
                names = ["dist"]
            bad = [n for n in names if n == "dist" or any(n == h or n.startswith(h + ".") for h in heavy)]
            assert not bad, f"{f.name}:{node.lineno} uses {bad}"
    # the check itself works
    probe = ast.parse("import torch.distributed as dist\nx = torch.distributed.get_rank()")
    assert any(isinstance(n, ast.Attribute) and _dotted(n).startswith("torch.distributed") for n in ast.walk(probe))
