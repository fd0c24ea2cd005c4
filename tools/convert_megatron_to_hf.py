#!/usr/bin/env python
"""Megatron torch_dist checkpoint -> HF safetensors (`hapo convert megatron-to-hf`).

Run `python tools/convert_megatron_to_hf.py --help`; under `torchrun --nproc-per-node TP*PP` for TP/PP > 1.
The logic lives in hapo_megatron/convert/cli.py.
"""

import os
import sys

# Importable from a plain checkout too (torchrun runs this file directly).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hapo_megatron.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
