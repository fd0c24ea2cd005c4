"""``hapo data prepare`` on tiny local copies of the paper's sets, each in its hub set's real columns
(docs/data.md): the files load in the trainer, verify with the math reward, hold no repeated
prompt, and a malformed row stops the command with the set and the row named. No network: local
files, a locally built datasets cache (HF_HUB_OFFLINE=1) and the character tokenizer."""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from hapo_megatron import cli
from hapo_megatron.data.dataset import PromptDataset
from hapo_megatron.data.math_sources import (DAPO_TEMPLATE_PREFIX, DAPO_TEMPLATE_SUFFIX, PAPER_SETS, SOURCES,
                                             MathSource, apply_template)
from hapo_megatron.data.prepare import convert_rows, percentile
from hapo_megatron.data.rows import load_prompt_rows
from hapo_megatron.rewards.math import compute_score
from tests.data import tiny_math_sets as tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_RECIPES = ["qwen2.5-math-7b", "qwen2.5-math-7b-sglang", "qwen2.5-math-1.5b", "qwen3-8b", "qwen3-30b-a3b"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from hapo_megatron.data.char_tokenizer import build_char_tokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    build_char_tokenizer(path)
    return path


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Local files go through the datasets cache: keep it in the test's own directory."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _prepare(name, out, tok, *extra):
    return cli.main(["data", "prepare", name, "--out", str(out), "--tokenizer", tok, "--no-progress", *extra])


def _pairs(path):
    """(problem, answer) of every row of a written file, the template taken off (checked)."""
    out = []
    for row in load_prompt_rows(path, prompt_key='prompt'):
        [msg] = row["prompt"]
        assert msg["role"] == "user"
        assert msg["content"].startswith(DAPO_TEMPLATE_PREFIX) and msg["content"].endswith(DAPO_TEMPLATE_SUFFIX)
        out.append((msg["content"][len(DAPO_TEMPLATE_PREFIX):-len(DAPO_TEMPLATE_SUFFIX)],
                    row["reward_model"]["ground_truth"]))
    return out


def test_the_template_is_dapos():
    """The words DAPO-Math-17k's prompts carry and the math reward reads ("Answer:" line)."""
    assert apply_template("P") == (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nP\n\n"
        'Remember to put your answer on its own line after "Answer:".')


@pytest.mark.parametrize("name", list(tiny.BUILDERS))
def test_each_set_converts_loads_and_verifies(name, tmp_path, tok, capsys):
    """Each set's real columns map to rows the trainer loads; repeated prompts are removed (fails
    with the duplicate check removed from convert_rows); each answer verifies with the math reward."""
    out = tmp_path / "out"
    assert _prepare(name, out, tok, "--from", tiny.from_path(name, str(tmp_path))) == 0
    path = str(out / SOURCES[name].out_file)
    assert _pairs(path) == tiny.EXPECTED[name]
    rows = load_prompt_rows(path, prompt_key='prompt')
    assert {r["data_source"] for r in rows} == {SOURCES[name].data_source}
    from transformers import AutoTokenizer
    dataset = PromptDataset(path, AutoTokenizer.from_pretrained(tok), max_prompt_length=1024,
        prompt_key='prompt', apply_chat_template=True)
    assert len(dataset) == len(tiny.EXPECTED[name])
    for rec in dataset:
        assert compute_score(f"Some steps.\nAnswer: {rec.ground_truth}", rec.ground_truth, score_format="pm1").acc
        assert not compute_score("Some steps.\nAnswer: 123456789", rec.ground_truth, score_format="pm1").acc
    err = capsys.readouterr().err
    read = {"dapo-math-17k": 7, "amc-2023": 3}.get(name, 3)
    assert f"{name}: {read} rows read" in err


def test_counts_of_the_dapo_copies(tmp_path, tok, capsys):
    """7 rows: 3 copies of one prompt (2 removed), a prompt whose 2 copies disagree (both dropped;
    fails with the conflict drop removed from convert_rows)."""
    assert _prepare("dapo-math-17k", tmp_path / "out", tok, "--from", tiny.dapo(str(tmp_path))) == 0
    err = capsys.readouterr().err
    assert ("7 rows read from" in err and "3 duplicated prompts removed, 1 prompts with conflicting answers "
            "dropped, 3 written" in err), err


def test_amc_keeps_2023_and_reads_the_float_answer(tmp_path, tok, capsys):
    """AMC 2022 rows are skipped; the float64 answer 144.0 becomes "144" (fails with the year filter
    removed, or with the float answer written as repr: "144.0")."""
    assert _prepare("amc-2023", tmp_path / "out", tok, "--from", tiny.from_path("amc-2023", str(tmp_path))) == 0
    assert "1 not in the set, 1 duplicated prompts removed" in capsys.readouterr().err
    assert _pairs(str(tmp_path / "out" / "amc23.parquet")) == [("What is $12 \\cdot 12$?", "144")]


def test_math_verify_equivalence_on_a_math500_answer(tmp_path, tok):
    """A ground truth kept as LaTeX (\\frac{1}{2}) still verifies an equivalent answer (0.5)."""
    assert _prepare("math-500", tmp_path / "out", tok, "--from", tiny.math_500(str(tmp_path))) == 0
    truth = load_prompt_rows(str(tmp_path / "out" / "math500.parquet"),
        prompt_key='prompt')[0]["reward_model"]["ground_truth"]
    assert truth == "\\frac{1}{2}"
    assert compute_score("So it is one half.\nAnswer: 0.5", truth, score_format="pm1").acc


MALFORMED = {"dapo-math-17k": (4, "reward_model.*'ground_truth' must be a string or number, got None"),
             "aime-2024": (3, "column 'Answer' must be a string or number, got None"),
             "aime-2025": (1, "column 'problem' is empty"),
             "math-500": (2, "column 'answer' is empty"),
             "amc-2023": (1, "cannot read the contest year from url")}


@pytest.mark.parametrize("name", list(tiny.BUILDERS))
def test_a_malformed_row_stops_the_command_naming_it(name, tmp_path, tok, capsys):
    """The command exits 2 naming the set, the source and the row, and writes no file."""
    src = tiny.from_path(name, str(tmp_path), malformed=True)
    assert _prepare(name, tmp_path / "out", tok, "--from", src) == 2
    index, what = MALFORMED[name]
    err = capsys.readouterr().err
    assert f"hapo: error: {name} ({src}): row {index}" in err, err
    import re
    assert re.search(what, err), err
    assert not glob.glob(str(tmp_path / "out" / "*.parquet"))


def test_the_loader_check_catches_a_row_an_adapter_got_wrong():
    """Every row goes through rows.validate_row before it is kept (fails with that call removed)."""
    def adapt(row, where):  # a faulty adapter: the second row's answer is a list
        return f"problem {row['q']}", ["4"] if row["q"] else "4", {}

    bad = MathSource("bad", "x/y", "train", "bad.parquet", "bad", adapt, "")
    with pytest.raises(ValueError, match=r"bad \(local\): row 1: field 'reward_model.ground_truth' must be a "
                                         r"string or number, got list"):
        convert_rows(bad, [{"q": 0}, {"q": 1}], "local", progress=False)


def test_a_prompt_in_another_template_is_refused():
    """A verl-layout row whose prompt asks for another answer format is not templated twice (and
    DAPO-Math-17k's own template is taken off before it is put back: test_each_set_converts fails
    for dapo-math-17k without strip_template)."""
    row = {"prompt": [{"role": "user", "content": "Solve the following math problem step by step. Put the answer "
                                                  "in \\boxed{}.\n\n1+1"}],
           "reward_model": {"ground_truth": "2"}}
    with pytest.raises(ValueError, match=r"aime-2024 \(f\): row 0: the prompt carries an instruction template"):
        convert_rows(SOURCES["aime-2024"], [row], "f", progress=False)


def test_percentile_nearest_rank():
    assert [percentile(range(1, 11), p) for p in (50, 90, 99, 100)] == [5, 9, 10, 10]
    assert percentile([7], 50) == 7
    assert percentile([3, 1, 2, 100], 50) == 2


def test_lengths_in_tokens_and_the_count_over_max_prompt_length(tmp_path, tok, capsys):
    """The character tokenizer makes one token per character plus 4 of its chat template (bos,
    <|user|>, eos, <|assistant|>). The template has 178 + 62 characters around the problem, so the two
    AIME 2024 prompts (22 and 36 characters) are 178 + 62 + 22 + 4 = 266 and 280 tokens; with
    --max-prompt-length 270 one is over. Without the chat template: 262 and 276 (fails when
    --no-chat-template is not passed on to the length measurement)."""
    assert len(DAPO_TEMPLATE_PREFIX) == 178 and len(DAPO_TEMPLATE_SUFFIX) == 62
    capsys.readouterr()
    assert _prepare("aime-2024", tmp_path / "out", tok, "--from", tiny.aime_2024(str(tmp_path)),
                    "--max-prompt-length", "270") == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"prompt lengths in tokens of {tok} (data.max_prompt_length 270)"
    assert lines[1].split() == ["set", "read", "duplicates", "written", "p50", "p90", "p99", "max", ">", "270",
                                "file"]
    assert lines[2].split() == ["aime-2024", "3", "1", "2", "266", "280", "280", "280", "1",
                                str(tmp_path / "out" / "aime24.parquet")]
    # without the chat template the 4 template tokens go (plain text gets the tokenizer's own specials: none)
    assert _prepare("aime-2024", tmp_path / "plain", tok, "--from", tiny.aime_2024(str(tmp_path)),
                    "--no-chat-template") == 0
    assert capsys.readouterr().out.splitlines()[2].split()[4:8] == ["262", "276", "276", "276"]


def test_paper_writes_the_files_the_gpu_recipes_read(tmp_path, tok, capsys):
    """`paper` from five local copies writes exactly the files the GPU recipes' configs name under data/
    (fails when a set's out_file or a config path is renamed)."""
    from_args = []
    for name in PAPER_SETS:
        from_args += ["--from", f"{name}={tiny.from_path(name, str(tmp_path / name))}"]
    out = tmp_path / "data"
    assert _prepare("paper", out, tok, *from_args) == 0
    written = sorted(os.listdir(out))
    assert written == sorted(SOURCES[n].out_file for n in PAPER_SETS)
    summary = capsys.readouterr().out
    assert [line.split()[0] for line in summary.splitlines()[2:]] == list(PAPER_SETS)
    for recipe in GPU_RECIPES:
        with open(os.path.join(ROOT, "examples", recipe, "config.yaml")) as f:
            data = yaml.safe_load(f)["data"]
        assert data["train_files"] == ["data/" + SOURCES["dapo-math-17k"].out_file], recipe
        assert data["val_files"] == ["data/" + SOURCES[n].out_file for n in PAPER_SETS[1:]], recipe


def test_from_with_paper_must_name_the_set(tmp_path, tok, capsys):
    assert _prepare("paper", tmp_path / "out", tok, "--from", "x.parquet") == 2
    assert "with 'paper' give --from SET=PATH" in capsys.readouterr().err
    assert _prepare("aime-2024", tmp_path / "out", tok, "--from", "nowhere.parquet") == 2
    assert "--from nowhere.parquet: no such file or directory" in capsys.readouterr().err


def _hub_cache(hf_home, tmp_path):
    """What an online `load_dataset("Maxwell-Jia/AIME_2024")` leaves in HF_HOME: the prepared arrow
    cache under datasets/Maxwell-Jia___aime_2024/<config>/<version>/<hash>/, built here from a local
    copy of the repository (its directory renamed to the hub namespace)."""
    import datasets

    repo = tmp_path / "repo" / "AIME_2024"
    tiny.aime_2024(str(repo))
    cache = os.path.join(hf_home, "datasets")
    datasets.load_dataset(str(repo), cache_dir=cache)
    [built] = [d for d in os.listdir(cache) if os.path.isdir(os.path.join(cache, d))]
    shutil.move(os.path.join(cache, built), os.path.join(cache, "Maxwell-Jia___" + built))


def _run_offline(tmp_path, tok, hf_home):
    env = {**os.environ, "HF_HOME": hf_home, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    env.pop("HF_DATASETS_CACHE", None)
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, "-m", "hapo_megatron.cli", "data", "prepare", "aime-2024", "--out",
           str(tmp_path / "out"), "--tokenizer", tok, "--no-progress"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_hub_name_offline_from_the_datasets_cache(tmp_path, tok):
    """HF_HUB_OFFLINE=1 with the set in HF_HOME's datasets cache: the hub name loads from the cache;
    with an empty HF_HOME the command says what is missing instead of a traceback."""
    hf_home = str(tmp_path / "hf_home")
    _hub_cache(hf_home, tmp_path)
    done = _run_offline(tmp_path, tok, hf_home)
    assert done.returncode == 0, done.stderr
    assert "aime-2024: 3 rows read from Maxwell-Jia/AIME_2024" in done.stderr
    assert _pairs(str(tmp_path / "out" / "aime24.parquet")) == tiny.EXPECTED["aime-2024"]
    empty = _run_offline(tmp_path, tok, str(tmp_path / "empty_home"))
    assert empty.returncode == 2
    assert "hapo: error: aime-2024: cannot load 'Maxwell-Jia/AIME_2024'" in empty.stderr
    assert "HF_HUB_OFFLINE='1'" in empty.stderr and "--from PATH" in empty.stderr


def test_tokenizer_none_skips_lengths_but_still_reads_the_file_back(tmp_path, capsys):
    assert cli.main(["data", "prepare", "aime-2024", "--out", str(tmp_path / "out"), "--tokenizer", "none",
                     "--no-progress", "--from", tiny.aime_2024(str(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "prompt lengths not measured (--tokenizer none)"
    assert lines[2].split()[:8] == ["aime-2024", "3", "1", "2", "-", "-", "-", "-"]


def test_without_the_datasets_library_the_command_says_what_to_install(tmp_path, tok, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    assert _prepare("aime-2024", tmp_path / "out", tok, "--from", str(tmp_path)) == 2
    assert "pip install -e '.[data]'" in capsys.readouterr().err


def test_gpu_recipe_readmes_prepare_their_data_with_their_tokenizer():
    """Each GPU recipe's README gives the command, measuring lengths with the tokenizer of its own
    model (the default --tokenizer where none is given; fails with the 1.5B README's tokenizer set to
    the 7B one); the 7B one names the authors' 32k model."""
    import re
    default = cli.build_parser().parse_args(["data", "prepare", "paper", "--out", "x"]).tokenizer
    for recipe in GPU_RECIPES:
        with open(os.path.join(ROOT, "examples", recipe, "README.md")) as f:
            readme = f.read()
        with open(os.path.join(ROOT, "examples", recipe, "config.yaml")) as f:
            model = yaml.safe_load(f)["model"]["hf_model_path"]
        found = re.search(r"hapo data prepare paper --out data(?: --tokenizer ([^\s`]+))?", readme)
        assert found, f"{recipe}/README.md does not give `hapo data prepare paper --out data`"
        assert (found.group(1) or default) == model, recipe
    with open(os.path.join(ROOT, "examples", "qwen2.5-math-7b", "README.md")) as f:
        readme = f.read()
    assert "model.hf_model_path=starriver030515/Qwen2.5-Math-7B-32k" in readme
    assert "max_position_embeddings: 32768" in readme
