# hapo_megatron GPU image.
#
# Base: the NGC PyTorch container, which brings CUDA, cuDNN, NCCL, PyTorch, Transformer Engine
# and Apex built together. On top: pinned megatron-core, SGLang, wandb, math-verify, ModelOpt
# (requirements/*.txt) and this package. The container's torch is never reinstalled: a pip
# constraints file written at build time pins torch & co. to the versions already installed,
# so any dependency that would replace them makes the build fail instead.
#
#   docker build -t hapo-megatron .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v $PWD/runs:/workspace/runs -v $HOME/.cache/huggingface:/root/.cache/huggingface \
#       hapo-megatron hapo train --config examples/qwen2.5_math_7b/hapo.yaml
#
# nvcr.io/nvidia/pytorch:26.03-py3 ships Python 3.12 and torch 2.11.0a0, matching the torch
# 2.11 that sglang 0.5.17's kernels are built for. Change both together.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.03-py3
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false

# Freeze the container's torch stack: every later pip call runs under this constraints file.
RUN mkdir -p /opt/hapo \
    && pip list --format=freeze \
       | grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton|transformer[-_]engine[-_a-z0-9]*|apex)==' \
       > /opt/hapo/keep-torch.txt \
    && python -c "import torch; print(torch.__version__)" > /opt/hapo/torch-version.txt \
    && cat /opt/hapo/keep-torch.txt /opt/hapo/torch-version.txt
ENV PIP_CONSTRAINT=/opt/hapo/keep-torch.txt

WORKDIR /opt/hapo_megatron

# Dependencies first (a separate layer, rebuilt only when the requirement files change).
COPY requirements/ requirements/
RUN pip install -r requirements/base.txt
# SGLang pins an exact PyPI torch: install it without dependencies, then its other dependencies.
RUN pip install --no-deps -r requirements/sglang.txt \
    && pip install -r requirements/sglang-runtime.txt

# The package itself, editable so that mounted source changes take effect.
COPY setup.cfg pyproject.toml README.md ./
COPY hapo_megatron/ hapo_megatron/
COPY tools/ tools/
COPY examples/ examples/
RUN pip install --no-deps -e .

# Fail the build if torch was replaced or an import is broken.
RUN python -c "import sys, torch; want = open('/opt/hapo/torch-version.txt').read().strip(); sys.exit(0 if torch.__version__ == want else f'torch changed: {torch.__version__} != {want}')" \
    && python -c "import megatron.core, sglang, wandb, math_verify, modelopt, hapo_megatron; print('hapo_megatron', hapo_megatron.__version__, '| sglang', sglang.__version__, '| megatron-core', megatron.core.__version__)" \
    && hapo --help > /dev/null

WORKDIR /workspace
CMD ["bash"]
