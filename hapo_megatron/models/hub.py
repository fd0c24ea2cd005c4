"""A model named by a Hugging Face hub id (``Qwen/Qwen2.5-Math-7B``) -> a local snapshot directory.

The trainer resolves `model.hf_model_path` (and a hub-named `data.tokenizer_path`) once at start,
before anything reads it, so the actor's initial weights, the tokenizer, the SGLang servers and
the HF exports all read the same local files (docs/configuration.md, `model.hf_model_path`).
`huggingface_hub.snapshot_download` does the work: it honours `HF_HOME` / `HF_HUB_CACHE` and
`HF_HUB_OFFLINE` (offline, it returns the cached snapshot or fails).
"""

from __future__ import annotations

import os
import re
from typing import Optional

# What a model directory needs: config, safetensors weights (+ index), tokenizer files, chat
# template. Not the duplicate *.bin / *.pth / Flax / TF copies some repos also carry.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name


def _lock_path(repo_id: str) -> str:
    from huggingface_hub import constants
    return os.path.join(constants.HF_HUB_CACHE, ".locks", "hapo_megatron", repo_id.replace("/", "--") + ".lock")


def resolve_model_path(name: Optional[str], field: str = "model.hf_model_path") -> Optional[str]:
    """``name`` itself when it is a local directory (or None); else the local snapshot of the hub
    repo ``name``, downloaded into the HF cache if it is not there yet.

    Every process of a node calls this before any process group exists, so the processes are
    ordered by a file lock in the HF cache: the first to take it (normally local rank 0, which
    torchrun starts first) downloads; the others wait on the lock and then find every file cached
    (snapshot_download skips files it already has). ValueError naming ``field`` when ``name`` is
    neither a directory nor a hub repo that can be fetched.
    """
    if not name or os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise ValueError(f"{field}: {name!r} is a file, not a model directory")
    if not looks_like_repo_id(name):
        raise FileNotFoundError(f"{field}: {name!r} does not exist (neither a local directory nor a hub "
                                "name such as Qwen/Qwen2.5-Math-7B)")
    from filelock import FileLock
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    from hapo_megatron.hub_offline import go_offline_if_unreachable

    go_offline_if_unreachable()  # unreachable: the cached snapshot or one line, not a minute of retries
    lock = _lock_path(name)
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    try:
        with FileLock(lock):
            return snapshot_download(name, allow_patterns=MODEL_FILES)
    except LocalEntryNotFoundError as e:  # offline (HF_HUB_OFFLINE=1 or no network) and not cached
        raise ValueError(f"{field}: {name!r} is not a local directory and is not in the HF cache "
                         f"({os.path.dirname(os.path.dirname(os.path.dirname(lock)))}) while the hub "
                         f"cannot be reached (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}): "
                         f"download it first or pass a directory ({e})") from None
    except (RepositoryNotFoundError, HfHubHTTPError) as e:
        raise ValueError(f"{field}: cannot fetch {name!r} from the Hugging Face hub: {e}") from None
