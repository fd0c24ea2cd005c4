"""Row validation (jsonl + parquet), PromptDataset tokenization and the long-prompt check."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hapo_megatron.data import PromptDataset, build_char_tokenizer, load_prompt_rows, write_rows


def good_row(i=0, content="What is 1 + 2?"):
    return {"data_source": "toy", "prompt": [{"role": "user", "content": content}],
            "reward_model": {"ground_truth": "3", "style": "rule"}, "extra_info": {"index": i}}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def drop(d, *keys):
    out = json.loads(json.dumps(d))
    node = out
    for k in keys[:-1]:
        node = node[k]
    del node[keys[-1]]
    return out


BAD_ROWS = [
    (drop(good_row(), "prompt"), "missing field 'prompt'"),
    (drop(good_row(), "reward_model"), "field 'reward_model' is missing"),
    (drop(good_row(), "reward_model", "ground_truth"), "missing field 'reward_model.ground_truth'"),
    (drop(good_row(), "data_source"), "field 'data_source' is missing"),
    ({**good_row(), "prompt": [{"content": "hi"}]}, "field prompt[0].role is missing"),
    ({**good_row(), "prompt": [{"role": "user", "content": 5}]}, "field prompt[0].content is not a string"),
    ({**good_row(), "prompt": []}, "field 'prompt' must be a non-empty list"),
    ({**good_row(), "reward_model": {"ground_truth": [1, 2]}},
     "'reward_model.ground_truth' must be a string or number"),
    ({**good_row(), "extra_info": [1]}, "field 'extra_info' must be a mapping"),
    ([1, 2], "row 2 must be an object"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS)
def test_malformed_jsonl_row_names_file_row_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [good_row(0), "", good_row(1), bad])  # blank line skipped
    with pytest.raises(ValueError) as info:
        load_prompt_rows(path, prompt_key='prompt')
    assert f"{path}: row 2" in str(info.value) and message in str(info.value)


def test_invalid_json_line(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [good_row(), "{not json"])
    with pytest.raises(ValueError, match=r"x\.jsonl: row 1 \(line 2\) is not valid JSON"):
        load_prompt_rows(path, prompt_key='prompt')


def test_malformed_parquet_rows(tmp_path):
    rows = [good_row(0), good_row(1), good_row(2)]
    rows[1]["reward_model"] = {"ground_truth": None, "style": "rule"}
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: missing field 'reward_model\.ground_truth'"):
        load_prompt_rows(path, prompt_key='prompt')
    no_source = [drop(good_row(i), "data_source") for i in range(2)]
    path = str(tmp_path / "nosrc.parquet")
    pq.write_table(pa.Table.from_pylist(no_source), path)
    with pytest.raises(ValueError, match=r"nosrc\.parquet: row 0: field 'data_source' is missing"):
        load_prompt_rows(path, prompt_key='prompt')


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_prompt_rows(str(tmp_path / "x.csv"), prompt_key='prompt')
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompt_rows(str(tmp_path / "x.jsonl"), prompt_key='prompt')


def test_round_trip_and_normalisation(tmp_path):
    rows = [good_row(i) for i in range(3)]
    rows[0]["reward_model"]["ground_truth"] = 7  # numbers become strings
    rows[1]["prompt"] = "plain string prompt"  # one user message
    del rows[2]["reward_model"]["style"]
    loaded = load_prompt_rows(write_rows(rows, str(tmp_path / "r.jsonl")), prompt_key='prompt')
    assert loaded[0]["reward_model"]["ground_truth"] == "7"
    assert loaded[1]["prompt"] == [{"role": "user", "content": "plain string prompt"}]
    assert loaded[2]["reward_model"] == {"ground_truth": "3", "style": "rule"}
    assert loaded[2]["extra_info"] == {"index": 2}
    # parquet columns have one type: numeric ground truths, no extra_info
    rows = [{k: v for k, v in good_row(i).items() if k != "extra_info"} for i in range(3)]
    for i, row in enumerate(rows):
        row["reward_model"] = {"ground_truth": i + 0.5}
    loaded = load_prompt_rows(write_rows(rows, str(tmp_path / "r.parquet")), prompt_key='prompt')
    assert [r["reward_model"]["ground_truth"] for r in loaded] == ["0.5", "1.5", "2.5"]
    assert all(r["extra_info"] == {} and r["prompt"] == rows[0]["prompt"] for r in loaded)
    # normalised rows can be written back (an all-empty extra_info column is dropped for parquet)
    assert load_prompt_rows(write_rows(loaded, str(tmp_path / "again.parquet")), prompt_key='prompt') == loaded


def test_dataset_tokenizes_with_chat_template(tmp_path, tok):
    a = write_rows([good_row(i, f"What is {i} + 1?") for i in range(3)], str(tmp_path / "a.jsonl"))
    b = write_rows([good_row(i, f"Compute {i} * 2.") for i in range(2)], str(tmp_path / "b.parquet"))
    ds = PromptDataset([a, b], tok, max_prompt_length=64, prompt_key='prompt', apply_chat_template=True)
    assert len(ds) == 5
    assert [r.uid for r in ds] == ["0-a-0", "0-a-1", "0-a-2", "1-b-0", "1-b-1"]
    rec = ds[3]
    assert rec.prompt_text == "<bos><|user|>Compute 0 * 2.<eos><|assistant|>"
    assert rec.prompt_ids == tok(rec.prompt_text, add_special_tokens=False)["input_ids"]
    assert rec.prompt_ids[0] == tok.bos_token_id and rec.prompt_ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert (rec.ground_truth, rec.data_source, rec.index) == ("3", "toy", 3)
    # the same files give the same uids and ids
    again = PromptDataset([a, b], tok, max_prompt_length=64, prompt_key='prompt', apply_chat_template=True)
    assert [(r.uid, r.prompt_ids) for r in again] == [(r.uid, r.prompt_ids) for r in ds]


def test_dataset_without_chat_template_joins_contents(tmp_path, tok):
    row = good_row()
    row["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]
    path = write_rows([row], str(tmp_path / "s.jsonl"))
    ds = PromptDataset(path, tok, max_prompt_length=64, apply_chat_template=False, prompt_key='prompt')
    assert ds[0].prompt_text == "Be brief.\nWhat is 1 + 2?"
    assert tok.decode(ds[0].prompt_ids) == "Be brief.\nWhat is 1 + 2?"


def test_long_prompt_fails_at_construction(tmp_path, tok):
    rows = [good_row(0, "short"), good_row(1, "x" * 50), good_row(2, "y" * 60)]
    path = write_rows(rows, str(tmp_path / "long.jsonl"))
    n1 = 50 + 4  # <bos> <|user|> ... <eos> <|assistant|>
    with pytest.raises(ValueError) as info:
        PromptDataset(path, tok, max_prompt_length=40, prompt_key='prompt', apply_chat_template=True)
    msg = str(info.value)
    assert f"{path}: row 1 has a prompt of {n1} tokens > max_prompt_length=40" in msg
    assert "2 of 3 rows" in msg and "data.filter_overlong_prompts=true" in msg
    with pytest.raises(ValueError, match="max_prompt_length must be >= 1"):
        PromptDataset(path, tok, max_prompt_length=0, prompt_key='prompt', apply_chat_template=True)


def test_long_prompts_filtered_and_counted(tmp_path, tok):
    long_a = write_rows([good_row(0, "short"), good_row(1, "x" * 50), good_row(2, "y" * 60), good_row(3, "ok")],
                        str(tmp_path / "a.jsonl"))
    b = write_rows([good_row(0, "z" * 45), good_row(1, "fine")], str(tmp_path / "b.jsonl"))
    ds = PromptDataset([long_a, b], tok, max_prompt_length=40, filter_overlong=True,
        prompt_key='prompt', apply_chat_template=True)
    assert ds.num_overlong_filtered == 3
    assert [r.uid for r in ds] == ["0-a-0", "0-a-3", "1-b-1"]  # uids keep the file's row numbers
    assert [r.index for r in ds] == [0, 1, 2] and [ds[i].index for i in range(3)] == [0, 1, 2]
    assert [r.prompt_text for r in ds] == [r.prompt_text for r in PromptDataset(
        write_rows([good_row(0, "short"), good_row(3, "ok"), good_row(1, "fine")], str(tmp_path / "c.jsonl")),
        tok, max_prompt_length=40, prompt_key='prompt', apply_chat_template=True)]
    assert max(len(r.prompt_ids) for r in ds) <= 40
    assert PromptDataset(b, tok, max_prompt_length=64, filter_overlong=True,
        prompt_key='prompt', apply_chat_template=True).num_overlong_filtered == 0
