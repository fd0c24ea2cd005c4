# hapo_megatron GPU image: one coherent stack built around the torch that SGLang's kernels need.
#
#   docker build -t hapo-megatron .
#   docker run --rm -it --gpus all --ipc=host --network=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -v $PWD/data:/workspace/data -v $PWD/runs:/workspace/runs \
#       -v $HOME/.cache/huggingface:/root/.cache/huggingface hapo-megatron          # the default recipe
#   docker run ... hapo-megatron hapo doctor                                          # check the machine
#
# Why this base (docs/docker.md): sglang-kernel 0.4.10 (pinned by sglang 0.5.23) is compiled against
# libtorch 2.14.1 and declares torch==2.14.1 exactly, so the image uses that PyPI torch (CUDA 13.0,
# cuDNN 9.24, NCCL 2.30.7 come with it) on a CUDA 13.0 *devel* base, and builds Transformer Engine's
# torch extension against it (megatron-core 0.16.1 declares transformer-engine>=2.9.0a0,<2.12.0:
# 2.11.0). An NGC PyTorch base would bring a pre-release torch build that SGLang's kernels were not
# compiled for. Apex is not installed: Transformer Engine provides the fused kernels Megatron uses.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# Python 3.12 (Ubuntu 24.04's) in a venv: the system interpreter refuses pip installs (PEP 668).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git curl ca-certificates \
       build-essential ninja-build libnuma1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/hapo_megatron
COPY requirements/ requirements/

# Every pip step installs exactly one lock file of requirements/lock/ (`--require-hashes --no-deps`):
# one resolution of the whole environment, split by step, with the hash of every file
# (tools/lock_requirements.py writes them from requirements/*.txt; docs/docker.md "The lock").
# 0. The packaging tools (pip 25.3, setuptools, wheel).
RUN pip install --require-hashes --no-deps -r requirements/lock/bootstrap.txt

# 1. The torch stack (requirements/torch.txt and its closure), then frozen: every later pip call runs
#    under a constraints file that pins the installed torch & co., ADDED to whatever constraints the
#    base image already sets (a later lock that disagreed would fail the build, not swap torch).
RUN pip install --require-hashes --no-deps -r requirements/lock/torch.txt \
    && mkdir -p /opt/hapo \
    && pip list --format=freeze \
       | grep -iE '^(torch|torchvision|triton|nvidia-[a-z0-9-]+|cuda-toolkit|cuda-bindings|cuda-python|cuda-pathfinder)==' \
       > /opt/hapo/keep-torch.txt \
    && python -c "import torch; print(torch.__version__)" > /opt/hapo/torch-version.txt \
    && cat /opt/hapo/keep-torch.txt /opt/hapo/torch-version.txt
ENV PIP_CONSTRAINT="${PIP_CONSTRAINT:+${PIP_CONSTRAINT} }/opt/hapo/keep-torch.txt"

# 2. Transformer Engine (requirements/te.txt): its torch extension, an sdist, compiled against that
#    torch (FORCE_BUILD: never a prebuilt wheel made for another torch; MAX_JOBS bounds the RAM of
#    the compile).
RUN NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-8} \
    pip install --no-build-isolation --require-hashes --no-deps -r requirements/lock/te.txt

# 3. SGLang without its dependencies (it declares torchaudio/torchcodec built for other torch
#    versions), then the rest of the environment: our dependencies (requirements/base.txt) and
#    SGLang's (requirements/sglang-runtime.txt), resolved together with everything above
#    (tests/test_dockerfile.py checks offline that the locks meet every declared requirement).
RUN pip install --require-hashes --no-deps -r requirements/lock/sglang.txt \
    && pip install --require-hashes --no-deps -r requirements/lock/image.txt

# 4. The package itself, editable so that a checkout mounted over /opt/hapo_megatron takes effect.
COPY setup.cfg pyproject.toml README.md ./
COPY hapo_megatron/ hapo_megatron/
COPY tools/ tools/
COPY examples/ examples/
RUN pip install --no-deps -e .

# 5. Smoke test: torch unchanged, and every compiled piece imports. There is no GPU during
#    `docker build`, so the driver library is the CUDA toolkit's stub (only for this step);
#    `hapo doctor` repeats these imports, and runs the kernels, on the GPU machine.
RUN mkdir -p /tmp/cuda-stub && ln -sf /usr/local/cuda/lib64/stubs/libcuda.so /tmp/cuda-stub/libcuda.so.1 \
    && export LD_LIBRARY_PATH=/tmp/cuda-stub:${LD_LIBRARY_PATH} \
    && python -c "import sys, torch; want = open('/opt/hapo/torch-version.txt').read().strip(); sys.exit(0 if torch.__version__ == want else f'torch changed: {torch.__version__} != {want}')" \
    && python -c "import torch, transformer_engine.pytorch, sgl_kernel, flashinfer, megatron.core, sglang, hapo_megatron; print('torch', torch.__version__, '| TE', transformer_engine.__version__, '| sgl_kernel', sgl_kernel.__version__, '| flashinfer', flashinfer.__version__, '| megatron-core', megatron.core.__version__, '| sglang', sglang.__version__)" \
    && python -c "import wandb, math_verify, modelopt, sglang.srt.sampling.custom_logit_processor" \
    && hapo doctor --only env,imports --strict \
    && rm -rf /tmp/cuda-stub

# Relative paths of the recipes (data/, runs/) resolve against /workspace: mount them there.
WORKDIR /workspace
# The default command: the paper's Qwen2.5-Math-7B recipe on every visible GPU of this node
# (launch.sh starts one torchrun rank per GPU; the trainer checks that TP x PP x CP = 2 x 1 x 2
# divides them). Any other command (bash, hapo doctor, hapo train ...) replaces it.
CMD ["bash", "/opt/hapo_megatron/examples/launch.sh", "/opt/hapo_megatron/examples/qwen2.5-math-7b/config.yaml"]
