"""The ``hapo`` command.

    hapo train   --config x.yaml [--preset hapo] [section.field=value ...]   (hapo_megatron.train)
    hapo eval    ...                                                          (hapo_megatron.evaluate)
    hapo convert hf-to-megatron|megatron-to-hf ...                            (hapo_megatron.convert.cli)
    hapo doctor  [--config X.yaml] [--only GROUPS] [--strict]                 (hapo_megatron.doctor)
    hapo analyze rollouts|compare|paired-stats|plot-run|plot-tokens ...       (hapo_megatron.analysis.cli)
    hapo config show [--config X] [--preset P] [overrides ...]
    hapo config presets | hapo config docs [SECTION]
    hapo data make-arithmetic --out PATH --n N --seed S [--min-digits ...]
    hapo data make-char-tokenizer --out DIR
    hapo data prepare {dapo-math-17k,aime-2024,aime-2025,math-500,amc-2023,paper} --out DIR [--from PATH] ...

``train``, ``eval``, ``convert``, ``doctor`` and ``analyze`` hand their remaining arguments untouched
to the ``main(argv)`` of their module, imported only when used (so ``hapo --help`` stays fast).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from hapo_megatron.refusal import OneLineParser, path_error_line, refuse

__all__ = ["main", "build_parser", "DISPATCH"]

DISPATCH = {
    "train": ("hapo_megatron.train", "run RL training (HAPO / DAPO / GRPO) from a config"),
    "eval": ("hapo_megatron.evaluate", "evaluate a checkpoint (avg@k / pass@k per data source)"),
    "convert": ("hapo_megatron.convert.cli", "convert checkpoints: hf-to-megatron | megatron-to-hf"),
    "doctor": ("hapo_megatron.doctor", "check this machine (GPU, NCCL, TE, kernels, SGLang, memory plan)"),
    "analyze": ("hapo_megatron.analysis.cli",
                "analyze runs: rollouts | compare | paired-stats | plot-run | plot-tokens"),
}


PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)


def _dispatch(command: str, argv: list[str]) -> int:
    """A path a command cannot use (missing, a directory, not writable) is one line naming it,
    exit 2, whatever command met it (docs/troubleshooting.md, "Refusals")."""
    module_name, _ = DISPATCH[command]
    try:
        rc = importlib.import_module(module_name).main(argv)
    except PATH_ERRORS as err:
        return refuse(f"hapo {command}", path_error_line(err), rank=int(os.environ.get("RANK", 0)))
    return int(rc or 0)


def _config_show(args) -> int:
    from hapo_megatron.config import format_config, load_config

    cfg = load_config(args.config, args.overrides, preset=args.preset)
    sys.stdout.write(format_config(cfg))
    return 0


def _config_presets(args) -> int:
    from hapo_megatron.presets import PRESET_DESCRIPTIONS, PRESETS

    for name in PRESETS:
        print(f"{name:22s} {PRESET_DESCRIPTIONS.get(name, '')}")
        if args.verbose:
            for key, value in PRESETS[name].items():
                print(f"    {key}={value}")
    return 0


def _config_docs(args) -> int:
    import dataclasses

    from hapo_megatron import config as C

    root = C.HapoConfig()
    sections = [f.name for f in dataclasses.fields(root)]
    if args.section and args.section not in sections:
        print(f"unknown section {args.section!r}; sections: {', '.join(sections)}", file=sys.stderr)
        return 2

    def walk(obj, prefix):
        docs = C.key_docs(type(obj))
        for key, value in obj.to_dict().items():
            sub = getattr(obj, key, None)
            if isinstance(sub, C._Section):
                walk(sub, f"{prefix}{key}.")
                continue
            print(f"{prefix}{key} = {value!r}\n    {docs.get(key, '').replace(chr(10), chr(10) + '    ')}")

    for name in sections:
        if args.section in (None, name):
            walk(getattr(C.HapoConfig(), name), f"{name}.")
    return 0


def _data_make_arithmetic(args) -> int:
    from hapo_megatron.data.arithmetic import write_arithmetic_dataset

    path = write_arithmetic_dataset(args.out, args.n, args.seed, min_digits=args.min_digits,
                                    max_digits=args.max_digits, min_operands=args.min_operands,
                                    max_operands=args.max_operands, ops=tuple(args.ops),
                                    data_source=args.data_source)
    print(f"wrote {args.n} problems to {path}", file=sys.stderr)
    return 0


def _data_make_char_tokenizer(args) -> int:
    from hapo_megatron.data.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(args.out)
    print(f"wrote a {len(tok)}-token character tokenizer to {args.out}", file=sys.stderr)
    return 0


def _from_paths(name: str, entries: list[str]) -> dict[str, str]:
    """``--from PATH`` (one set) or ``--from SET=PATH`` (any set of the bundle) -> {set: path}."""
    from hapo_megatron.data.prepare import set_names

    names, out = set_names(name), {}
    for entry in entries:
        key, sep, path = entry.partition("=")
        if not sep or key not in names:
            if len(names) > 1:
                raise ValueError(f"--from {entry!r}: with {name!r} give --from SET=PATH, SET one of {list(names)}")
            key, path = names[0], entry
        if key in out:
            raise ValueError(f"--from names {key!r} twice")
        out[key] = path
    return out


def _load_tokenizer(name: str):
    """The length report's tokenizer, or None (``none``, or it cannot be loaded: the report is
    skipped with one warning, the sets are still written)."""
    if name.lower() == "none":
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"warning: --tokenizer {name!r} cannot be loaded ({first}): the prompt-length report is skipped; "
              "give a local tokenizer directory or a hub name in the HF cache to get it", file=sys.stderr)
        return None


def _data_prepare(args) -> int:
    from hapo_megatron.data.prepare import prepare, set_names
    from hapo_megatron.hub_offline import go_offline_if_unreachable

    from_paths = _from_paths(args.name, args.from_paths or [])
    tokenizer_from_hub = args.tokenizer.lower() != "none" and not os.path.isdir(args.tokenizer)
    if tokenizer_from_hub or set(set_names(args.name)) - set(from_paths):  # something comes from the hub
        offline = go_offline_if_unreachable()  # before datasets / transformers try it and retry
        if offline:
            print(f"offline ({offline}): reading the Hugging Face caches only", file=sys.stderr)
    tokenizer = _load_tokenizer(args.tokenizer)
    prepare(args.name, args.out, from_paths=from_paths, tokenizer=tokenizer, tokenizer_name=args.tokenizer,
            max_prompt_length=args.max_prompt_length, apply_chat_template=args.apply_chat_template,
            progress=not args.no_progress)
    return 0


def _add_prepare_parser(dsub) -> None:
    from hapo_megatron.data.math_sources import SOURCES

    names = [*SOURCES, "paper"]
    pr = dsub.add_parser("prepare", help="download, convert and check the paper's math sets (docs/data.md)",
                         description="Write the paper's training / validation sets as prompt files in the project's "
                                     "layout with the DAPO prompt template (docs/data.md). 'paper' writes all five "
                                     "under the names the GPU recipes' configs read.")
    pr.add_argument("name", choices=names, help="the set, or 'paper' for all five")
    pr.add_argument("--out", required=True, help="output directory (the recipes read data/)")
    pr.add_argument("--from", dest="from_paths", action="append", metavar="[SET=]PATH",
                    help="read a local copy (.parquet / .jsonl / .json file, a saved dataset or a copy of the hub "
                         "repository) instead of the hub; with 'paper' give SET=PATH (repeatable)")
    pr.add_argument("--tokenizer", default="Qwen/Qwen2.5-Math-7B",
                    help="tokenizer for the length report (hub name or directory; 'none' skips it)")
    pr.add_argument("--max-prompt-length", type=int, default=1024, help="data.max_prompt_length of the recipe")
    pr.add_argument("--no-chat-template", dest="apply_chat_template", action="store_false",
                    help="measure lengths without the chat template (as data.apply_chat_template=false)")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    pr.set_defaults(func=_data_prepare)


def _add_config_parser(sub) -> None:
    p = sub.add_parser("config", help="show the resolved config, presets, field docs")
    csub = p.add_subparsers(dest="config_command", metavar="{show,presets,docs}", required=True)
    show = csub.add_parser("show", help="print the resolved config as YAML")
    show.add_argument("--config", "-c", default=None, help="YAML config file")
    show.add_argument("--preset", "-p", default=None, help="preset applied before the YAML file")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.clip_ratio_high=0.28")
    show.set_defaults(func=_config_show)
    presets = csub.add_parser("presets", help="list the presets")
    presets.add_argument("--verbose", "-v", action="store_true", help="also print each preset's overrides")
    presets.set_defaults(func=_config_presets)
    docs = csub.add_parser("docs", help="every config field with its default and description")
    docs.add_argument("section", nargs="?", default=None)
    docs.set_defaults(func=_config_docs)


def _add_data_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare the paper's math sets; make the offline arithmetic set and tokenizer")
    dsub = p.add_subparsers(dest="data_command", metavar="{prepare,make-arithmetic,make-char-tokenizer}",
                            required=True)
    _add_prepare_parser(dsub)
    ar = dsub.add_parser("make-arithmetic", help="write a generated integer-arithmetic prompt file")
    ar.add_argument("--out", required=True, help="output file (.jsonl or .parquet)")
    ar.add_argument("--n", type=int, required=True, help="number of problems")
    ar.add_argument("--seed", type=int, default=0)
    ar.add_argument("--min-digits", type=int, default=1)
    ar.add_argument("--max-digits", type=int, default=2)
    ar.add_argument("--min-operands", type=int, default=2)
    ar.add_argument("--max-operands", type=int, default=3)
    ar.add_argument("--ops", default="+-*", help="operators to use, a subset of '+-*'")
    ar.add_argument("--data-source", default="arithmetic")
    ar.set_defaults(func=_data_make_arithmetic)
    tk = dsub.add_parser("make-char-tokenizer", help="save the tiny character tokenizer")
    tk.add_argument("--out", required=True, help="output directory")
    tk.set_defaults(func=_data_make_char_tokenizer)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hapo", description="HAPO (Heterogeneous Adaptive Policy Optimization) on Megatron-Core.",
        epilog="Run 'hapo <command> --help' for the options of a command.")
    from hapo_megatron import __version__

    parser.add_argument("--version", action="version", version=f"hapo_megatron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{train,eval,convert,doctor,analyze,config,data}",
                                required=True)
    for name, (module_name, help_text) in DISPATCH.items():
        # Listed for --help only: main() hands these commands to their module before parsing.
        sub.add_parser(name, help=help_text, add_help=False)
    _add_config_parser(sub)
    _add_data_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hapo`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DISPATCH:
        return _dispatch(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"hapo: error: {err}", file=sys.stderr)
        return 2
    except PATH_ERRORS as err:
        print(f"hapo: error: {path_error_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `hapo config docs | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
