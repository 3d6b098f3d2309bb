"""`hputrain train --model DIR --dataset PATH`: a local Hugging Face model fine-tuned (fully or
with LoRA) on local text, in-process through `hputrain.cli.main`, against transformers, peft and
the tokenizer themselves."""
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ..hf_fixtures import SAMPLE_TEXT, llama_folder, write_text_file  # noqa: F401

transformers = pytest.importorskip("transformers", reason="the Hugging Face recipe needs transformers")

from hputrain.cli import main  # noqa: E402
from hputrain.recipes import hf  # noqa: E402
from hputrain.recipes.hf import common as hf_common, data as hf_data

BLOCK = 32
SMALL = ["--precision", "32", "--block-size", str(BLOCK), "--per-device-train-batch-size", "4",
         "--disable-tqdm", "--logging-steps", "1", "--save-steps", "-1"]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture
def text_file(tmp_path):
    return write_text_file(tmp_path / "data.txt")


@pytest.fixture(scope="module")
def tokenizer(llama_folder):  # noqa: F811
    return transformers.AutoTokenizer.from_pretrained(llama_folder)


def train(out, model, dataset, *argv):
    return main(["train", "--model", str(model), "--dataset", str(dataset), "--output-dir", str(out),
                 *SMALL, *argv])


def losses(out):
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def final_or_skip(out, stdout):
    """output_dir/final, or a skip while export.save_model is not in this build (the run says so)."""
    if "final model not written" in stdout:
        pytest.skip("export.save_model is not implemented in this build: final/ is not written")
    return Path(out) / "final"


# -- training ------------------------------------------------------------------------------------

def test_full_fine_tune_writes_a_folder_transformers_loads(tmp_path, llama_folder, text_file, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert train(out, llama_folder, text_file, "--max-steps", "3", "--save-steps", "3") == 0
    stdout = capsys.readouterr().out
    assert "LlamaForCausalLM" in stdout and "of 37.79K parameters trainable" in stdout, stdout
    assert f"blocks of {BLOCK} tokens" in stdout and len(losses(out)) == 3
    final = final_or_skip(out, stdout)
    assert f'AutoModelForCausalLM.from_pretrained("{final}")' in stdout
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(final)
    original = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    from safetensors.torch import load_file

    trained = load_file(out / "checkpoint-3" / "model.safetensors")  # the trainer's own weights
    state = reloaded.state_dict()
    assert set(state) <= set(trained) and set(state) == set(original.state_dict())
    for name, value in state.items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(state["model.layers.0.self_attn.q_proj.weight"],
                           original.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)  # saved with it
    assert tokenizer("to be or not")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(llama_folder)("to be or not")["input_ids"]


def test_loss_goes_down_on_repeated_text(tmp_path, llama_folder, text_file):  # noqa: F811
    out = tmp_path / "run"
    assert train(out, llama_folder, text_file, "--max-steps", "20", "--learning-rate", "1e-2",
                 "--lr-scheduler-type", "constant", "--warmup-steps", "0") == 0
    loss = losses(out)
    assert len(loss) == 20 and np.mean(loss[-3:]) < 0.75 * np.mean(loss[:3]), loss


def test_lora_trains_only_adapters(tmp_path, llama_folder, text_file, capsys, monkeypatch):  # noqa: F811
    peft = pytest.importorskip("peft", reason="LoRA needs peft")
    wrapped, add_lora = [], hf.add_lora

    def keep(model, options):  # the model the recipe trains
        wrapped.append(add_lora(model, options))
        return wrapped[-1]

    monkeypatch.setattr(hf, "add_lora", keep)
    out = tmp_path / "lora"
    assert train(out, llama_folder, text_file, "--max-steps", "3", "--lora-r", "8",
                 "--learning-rate", "1e-2") == 0
    stdout = capsys.readouterr().out
    model = wrapped[0]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    # peft's own choice for Llama, counted by peft on a model wrapped here the same way
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(llama_folder),
                                    peft.LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16))
    expected = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    assert f"LoRA r=8 on q_proj, v_proj, {hf_common._count(expected)} of" in stdout, stdout
    final = final_or_skip(out, stdout)
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    loaded = peft.PeftModel.from_pretrained(base, final)
    lora_b = {n: p for n, p in loaded.named_parameters() if ".lora_B." in n}
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b.values())  # zero at start: it trained
    assert f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(\"{llama_folder}\")" in stdout


# -- data ----------------------------------------------------------------------------------------

def _blocks(path, tokenizer, tmp_path, **kw):
    kw = {"validation_percentage": 0, "cache_dir": tmp_path / "cache"} | kw
    return hf_data.load_blocks(str(path), tokenizer, BLOCK, **kw)


def _save_to_disk(folder, texts, split=None):
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    (datasets.DatasetDict({split: data}) if split else data).save_to_disk(str(folder))
    return folder


def test_every_shape_of_data_set_gives_the_text_files_blocks(tmp_path, tokenizer, text_file):
    content = text_file.read_text()
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": content, "source": "x"}) + "\n")
    (tmp_path / "array.json").write_text(json.dumps([{"text": content}]))
    (tmp_path / "folder").mkdir()
    shutil.copy(text_file, tmp_path / "folder" / "only.txt")
    saved = _save_to_disk(tmp_path / "saved", [content])
    expected = _blocks(text_file, tokenizer, tmp_path).train.blocks
    ids = tokenizer(content, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert np.array_equal(expected.ravel(), ids[:expected.size])  # the tokenizer's own ids, packed
    for path in (tmp_path / "one.jsonl", tmp_path / "array.json", tmp_path / "folder", saved):
        got = _blocks(path, tokenizer, tmp_path).train.blocks
        assert np.array_equal(got, expected), path


def test_documents_are_separated_by_eos_in_every_shape(tmp_path, tokenizer):
    texts = [" ".join(SAMPLE_TEXT) * 3, "\n".join(SAMPLE_TEXT[::-1]) * 4, "hello world\n" * 20]
    (tmp_path / "docs").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "docs" / f"{i}.txt").write_text(text)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n\n" for t in texts))
    ids = sum((tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for t in texts), [])
    blocks = [_blocks(tmp_path / "docs", tokenizer, tmp_path).train.blocks,
              _blocks(tmp_path / "docs.jsonl", tokenizer, tmp_path, text_column="body").train.blocks,
              _blocks(_save_to_disk(tmp_path / "saved", texts), tokenizer, tmp_path).train.blocks,
              _blocks(_save_to_disk(tmp_path / "dict", texts, "train"), tokenizer, tmp_path).train.blocks]
    usable = len(ids) // BLOCK * BLOCK
    for got in blocks:
        assert np.array_equal(got, np.array(ids[:usable]).reshape(-1, BLOCK))


def test_samples_validation_split_and_long_documents(tmp_path, tokenizer, monkeypatch):
    path = write_text_file(tmp_path / "data.txt", lines=400)
    data = _blocks(path, tokenizer, tmp_path, validation_percentage=5)
    total = len(data.train) + len(data.validation)
    assert len(data.validation) == max(1, int(total * 5 / 100))
    sample = data.validation[len(data.validation) - 1]
    assert set(sample) == {"input_ids", "labels"} and sample["input_ids"].dtype == torch.int64
    assert sample["input_ids"].shape == (BLOCK,) and torch.equal(sample["input_ids"], sample["labels"])
    whole = np.concatenate([data.train.blocks, data.validation.blocks])
    # a document longer than a tokenizer call's piece, cut at line ends, gives the same tokens here
    monkeypatch.setattr(hf_data, "PIECE_CHARS", 500)
    again = _blocks(path, tokenizer, tmp_path / "other", validation_percentage=5)
    assert np.array_equal(np.concatenate([again.train.blocks, again.validation.blocks]), whole)


def _save_splits(folder, splits: dict):
    """A DatasetDict of {split: texts} written by save_to_disk."""
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": texts})
                          for name, texts in splits.items()}).save_to_disk(str(folder))
    return folder


def _packed(tokenizer, texts):
    ids = sum((tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for t in texts), [])
    return np.array(ids[:len(ids) // BLOCK * BLOCK]).reshape(-1, BLOCK)


TRAIN_TEXTS = [f"{i} {SAMPLE_TEXT[i % 4]}" for i in range(120)]
VALIDATION_TEXTS = [f"{SAMPLE_TEXT[i % 4][::-1]} {i}" for i in range(30)]


def test_a_dataset_dicts_own_validation_split_is_the_validation_set(tmp_path, tokenizer, monkeypatch):
    """As run_clm: a DatasetDict with a "validation" split is evaluated on that split (packed by
    itself), and training keeps every block of "train"; a "test" split is not one, and a
    percentage of 0 still means no evaluation. Each split has its own cache file, read back on the
    next load; the hold-out of a DatasetDict without one is cached apart from both."""
    calls = []
    real = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    folder = _save_splits(tmp_path / "dict", {"train": TRAIN_TEXTS, "validation": VALIDATION_TEXTS})
    data = _blocks(folder, tokenizer, tmp_path, validation_percentage=5)
    assert data.own_validation and not data.from_cache
    assert np.array_equal(data.train.blocks, _packed(tokenizer, TRAIN_TEXTS))  # nothing held out
    assert np.array_equal(data.validation.blocks, _packed(tokenizer, VALIDATION_TEXTS))
    files = sorted((tmp_path / "cache").glob("blocks-*.npy"))
    assert len(files) == 2 and data.cache_file in files
    calls.clear()
    again = _blocks(folder, tokenizer, tmp_path, validation_percentage=5)
    assert again.from_cache and again.own_validation and not calls
    assert np.array_equal(again.validation.blocks, data.validation.blocks)

    none = _blocks(folder, tokenizer, tmp_path, validation_percentage=0)
    assert none.validation is None and not none.own_validation
    assert np.array_equal(none.train.blocks, data.train.blocks)

    other = _save_splits(tmp_path / "test-split", {"train": TRAIN_TEXTS, "test": VALIDATION_TEXTS})
    held = _blocks(other, tokenizer, tmp_path, validation_percentage=10)
    assert not held.own_validation and held.cache_file not in files
    whole = _packed(tokenizer, TRAIN_TEXTS)
    assert np.array_equal(np.concatenate([held.train.blocks, held.validation.blocks]), whole)
    assert len(held.validation) == max(1, int(len(whole) * 10 / 100))


def test_a_validation_split_too_short_for_a_block_is_one_line(tmp_path, tokenizer):
    folder = _save_splits(tmp_path / "dict", {"train": TRAIN_TEXTS, "validation": ["short"]})
    with pytest.raises(hf_data.InputError, match=r"\(its validation split\) has \d+ tokens, fewer than one block"):
        _blocks(folder, tokenizer, tmp_path, validation_percentage=5)


# -- a folder of record files (issue 39 item 12) --------------------------------------------------

def _shards(folder, rows, parts=3, parquet=()):
    """`rows` cut into `parts` files of `folder`, in order: JSON Lines, or Parquet for the
    indices in `parquet`."""
    folder.mkdir(parents=True, exist_ok=True)
    cuts = np.array_split(np.arange(len(rows)), parts)
    for i, part in enumerate(cuts):
        chunk = [rows[j] for j in part]
        if i in parquet:
            pq = pytest.importorskip("pyarrow.parquet")
            import pyarrow as pa
            pq.write_table(pa.Table.from_pylist(chunk), folder / f"part-{i}.parquet")
        else:
            (folder / f"part-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))
    return folder


def test_a_folder_of_record_files_is_read_as_its_rows(tmp_path, tokenizer):
    """Its files are read by their kind (JSON Lines, Parquet), not as plain text: the blocks are
    those of the same rows in one file, and a validation/ subfolder (as --streaming lays shards
    out) is the validation split, packed by itself."""
    rows = [{"text": t, "id": i} for i, t in enumerate(TRAIN_TEXTS)]
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = _shards(tmp_path / "shards", rows, parquet=(1,))
    assert hf_data.columns_of(str(folder)) == ["text", "id"]
    got = _blocks(folder, tokenizer, tmp_path).train.blocks
    assert np.array_equal(got, _blocks(one, tokenizer, tmp_path).train.blocks)
    assert np.array_equal(got, _packed(tokenizer, TRAIN_TEXTS))
    _shards(folder / "validation", [{"text": t} for t in VALIDATION_TEXTS], parts=2)
    data = _blocks(folder, tokenizer, tmp_path, validation_percentage=5)
    assert data.own_validation and hf_data.saved_splits(str(folder)) == ["train", "validation"]
    assert np.array_equal(data.train.blocks, got)  # nothing held out, the validation rows not trained on
    assert np.array_equal(data.validation.blocks, _packed(tokenizer, VALIDATION_TEXTS))


def _method_of(path, **flags):
    """(what hf.data_kind says, the SFT / text method hf_data.data_method says, or the error line)."""
    options = hf.HFOptions(model="m", dataset=str(path), **flags)
    try:
        kind = hf.data_kind(options)
        return kind, hf_data.data_method(str(path)) if kind == "lm_or_sft" else None
    except hf_data.InputError as error:  # a file names its line, a folder the column
        return "error", re.sub(r" line \d+ has no '(\w+)' field", r" has no '\1' column",
                               str(error).replace(str(path), "DATA"))


ROWS = {
    "chat": [{"messages": [{"role": "user", "content": f"q{i}"},
                           {"role": "assistant", "content": f"a{i}"}]} for i in range(6)],
    "prompt-completion": [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(6)],
    "prompt-only": [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)],
    "pairs": [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(6)],
    "text": [{"text": f"t{i}"} for i in range(6)],
}


REWARDS = {"reward_funcs": ["rewards.py:f"]}


@pytest.mark.parametrize("kind, flags, want", [
    ("chat", {}, ("lm_or_sft", "messages")),
    ("prompt-completion", {}, ("lm_or_sft", "prompt_completion")),
    ("text", {}, ("lm_or_sft", "text")),
    ("pairs", {}, ("dpo", None)),
    ("prompt-only", REWARDS, ("grpo", None)),
    ("prompt-only", {}, ("error", "prompt, answer")),
    ("chat", REWARDS, ("error", "--reward-funcs")),
], ids=["chat", "prompt-completion", "text", "pairs", "prompts", "prompts-no-rewards", "chat-rewards"])
def test_a_folder_of_shards_takes_the_method_of_the_same_rows_in_one_file(tmp_path, kind, flags, want):
    """Chat, prompt-completion, text, prompt-only (GRPO) and pair (DPO) shards get the method, or
    the refusal, that the same rows in one file get; a folder of them was read as plain text. Its
    card (README.md, as a Hugging Face data set folder has) is not data."""
    rows = ROWS[kind]
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = _method_of(one, **flags)
    assert expected[0] == want[0] and (want[1] is None or want[1] in expected[1]), expected
    shards = _shards(tmp_path / "shards", rows, parquet=(2,))
    (shards / "README.md").write_text("---\nlicense: mit\n---\n# a data set card, not data\n")
    assert _method_of(shards, **flags) == expected
    if kind != "text":
        assert [r for _, r in hf_data.records(str(tmp_path / "shards"))] == rows  # rows, not text


@pytest.mark.parametrize("case", ["other files", "other rows"])
def test_a_folder_of_mixed_kinds_is_one_line(tmp_path, llama_folder, capsys, case):  # noqa: F811
    folder = _shards(tmp_path / "mixed", ROWS["chat"], parts=2)
    if case == "other files":
        (folder / "notes.txt").write_text("some text")
        words = ["mixes files of records (part-0.jsonl) with other files (notes.txt)"]
    else:
        (folder / "pairs.jsonl").write_text(json.dumps(ROWS["pairs"][0]) + "\n")
        words = ["mixes rows of different kinds", "part-0.jsonl has messages",
                 "pairs.jsonl has prompt, chosen, rejected"]
    assert train(tmp_path / "run", llama_folder, folder, "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_train_evaluates_on_the_validation_split_and_says_so(tmp_path, llama_folder, tokenizer, capsys):  # noqa: F811
    """The run's header names the validation set, and its eval_loss is the trained model's
    loss on the validation split's blocks, computed here with transformers."""
    folder = _save_splits(tmp_path / "dict", {"train": TRAIN_TEXTS, "validation": VALIDATION_TEXTS})
    out = tmp_path / "run"
    assert train(out, llama_folder, folder, "--max-steps", "2", "--per-device-eval-batch-size", "4") == 0
    expected = _packed(tokenizer, VALIDATION_TEXTS)
    stdout = capsys.readouterr().out
    assert f"validation: the data set's own validation split, {len(expected)} blocks" in stdout, stdout
    assert f"{len(_packed(tokenizer, TRAIN_TEXTS))} training and {len(expected)} validation blocks" in stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    eval_loss = next(r["eval_loss"] for r in records if "eval_loss" in r)
    model = transformers.AutoModelForCausalLM.from_pretrained(final_or_skip(out, stdout)).eval()
    ids = torch.from_numpy(expected.astype(np.int64))
    with torch.no_grad():
        losses_ = [model(input_ids=b, labels=b).loss for b in ids.split(4)]
    tokens = [len(b) * (BLOCK - 1) for b in ids.split(4)]
    want = sum(loss * n for loss, n in zip(losses_, tokens)) / sum(tokens)
    assert eval_loss == pytest.approx(want.item(), rel=1e-5)


def test_the_header_says_what_is_held_out(tmp_path, llama_folder, text_file, capsys):  # noqa: F811
    assert train(tmp_path / "run", llama_folder, text_file, "--max-steps", "1") == 0
    assert "validation: the last 5% of the blocks held out (--validation-split-percentage), " \
        in capsys.readouterr().out


def test_the_cache_is_reused_and_follows_the_inputs(tmp_path, tokenizer, text_file, monkeypatch):
    calls = []
    real = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    first = _blocks(text_file, tokenizer, tmp_path)
    assert calls and not first.from_cache and first.cache_file.is_file()
    calls.clear()
    second = _blocks(text_file, tokenizer, tmp_path)
    assert not calls and second.from_cache and np.array_equal(second.train.blocks, first.train.blocks)
    text_file.write_text(text_file.read_text() + "one more line, and the data set has changed\n")
    third = _blocks(text_file, tokenizer, tmp_path)
    assert calls and not third.from_cache and third.cache_file != first.cache_file
    calls.clear()
    fourth = hf_data.load_blocks(str(text_file), tokenizer, BLOCK * 2, validation_percentage=0,
                                 cache_dir=tmp_path / "cache")
    assert calls and fourth.train.blocks.shape[1] == BLOCK * 2


def test_a_second_run_reads_the_cache(tmp_path, llama_folder, text_file, capsys):  # noqa: F811
    for out in (tmp_path / "a", tmp_path / "b"):
        assert train(out, llama_folder, text_file, "--max-steps", "1", "--cache-dir",
                     str(tmp_path / "cache"), "--validation-split-percentage", "0") == 0
    first, second = [line for line in capsys.readouterr().out.splitlines() if "blocks of" in line]
    assert "cached in" in first and "from the cache" in second, (first, second)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")  # the same blocks, the same run


# -- bad input: one line, exit status 2 -----------------------------------------------------------

def _bad_inputs(tmp, model):
    (tmp / "no-config").mkdir()
    shutil.copy(model / "model.safetensors", tmp / "no-config")
    (tmp / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (tmp / "latin1.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 100)
    (tmp / "records.jsonl").write_text('{"content": "hi there"}\n' * 50)
    (tmp / "short.txt").write_text("too short")
    return {
        "no config": (["--model", str(tmp / "no-config")], ["has no config.json"]),
        "hub name": (["--model", "meta-llama/Llama-2-7b"],
                     ["not a folder on this machine", "huggingface-cli download meta-llama/Llama-2-7b"]),
        "binary": (["--dataset", str(tmp / "blob.bin")], ["blob.bin is not text", "NUL"]),
        "latin-1": (["--dataset", str(tmp / "latin1.txt")], ["not UTF-8"]),
        "no text field": (["--dataset", str(tmp / "records.jsonl")],
                          ["line 1 has no 'text' field", "content", "--text-column"]),
        "too short": (["--dataset", str(tmp / "short.txt")], ["fewer than one block"]),
        "no target": (["--lora-r", "4", "--lora-target-modules", "q_prj"],
                      ["no module named 'q_prj'", "did you mean 'q_proj'"]),
        "block too long": (["--block-size", "4096"], ["longer than the 128 positions"]),
        "model size": (["--model-size", "small"], ["--model-size is for the built-in GPT recipe"]),
        "alpha alone": (["--lora-alpha", "16"], ["--lora-alpha needs --lora-r"]),
        # the tracker's import is blocked in the test below (sys.modules["mlflow"] = None)
        "tracker missing": (["--report-to", "mlflow"], ["report_to='mlflow' needs the mlflow package"]),
    }


@pytest.mark.parametrize("case", ["no config", "hub name", "binary", "latin-1", "no text field",
                                  "too short", "no target", "block too long", "model size",
                                  "alpha alone", "tracker missing"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, llama_folder, text_file, capsys, monkeypatch,  # noqa: F811
                                          case):
    pytest.importorskip("peft", reason="LoRA needs peft")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    argv, words = _bad_inputs(tmp_path, llama_folder)[case]
    start = ["--model", str(llama_folder), "--dataset", str(text_file)]
    assert main(["train", *start, "--output-dir", str(tmp_path / "out"), *SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and err.startswith("hputrain: error:"), err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("argv, words", [
    (["--lora-r", "8"], ["--lora-r needs --model DIR"]),
    (["--dataset", "data.txt"], ["--dataset needs --model DIR"]),
])
def test_hf_options_without_model_are_one_line(tmp_path, capsys, argv, words):
    assert main(["train", "--output-dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_config_file_chooses_the_recipe_and_flags_outrank_it(tmp_path, llama_folder):  # noqa: F811
    from hputrain.recipes import merge_settings

    file_values = {"model": str(llama_folder), "dataset": "x.txt", "lora_r": 4, "learning_rate": 1e-3}
    options, args = merge_settings(hf, {"lora_r": 16, "config": "run.toml"}, file_values)
    assert (options.lora_r, args.learning_rate, args.logging_steps) == (16, 1e-3, 10)
    assert args.output_dir == str(Path("runs") / llama_folder.name)
    options, args = merge_settings(hf, {}, {"model": str(llama_folder), "dataset": "x.txt"})
    assert options.lora_r is None and args.learning_rate == 5e-5 and args.eval_steps == 0
    with pytest.raises(hf.ConfigError, match="seq_len in config file run.toml is for the built-in GPT"):
        merge_settings(hf, {"config": "run.toml"}, {"model": "m", "dataset": "d", "seq_len": 64})


def test_the_gpt_recipe_also_writes_final(tmp_path, capsys):
    """Without --model: the built-in GPT, whose final/ reloads to the weights it trained."""
    import os

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_bytes(Path(os.__file__).read_bytes()[:30_000])
    out = tmp_path / "gpt"
    assert main(["train", "--corpus", str(tmp_path / "corpus"), "--output-dir", str(out),
                 "--max-steps", "2", "--seq-len", "32", "--per-device-train-batch-size", "4",
                 "--eval-batches", "1", "--precision", "32", "--disable-tqdm", "--save-steps", "2"]) == 0
    final = final_or_skip(out, capsys.readouterr().out)
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    from safetensors.torch import load_file

    from hputrain.models.gpt import GPT

    state = GPT.from_pretrained(final).state_dict()
    trained = load_file(out / "checkpoint-2" / "model.safetensors")
    assert set(trained) <= set(state)
    for name, value in trained.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def test_from_scratch_keeps_the_architecture_and_not_the_weights(llama_folder):  # noqa: F811
    original = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    torch.manual_seed(1)
    fresh, tokenizer = hf.load_model(llama_folder, from_scratch=True)
    loaded, _ = hf.load_model(llama_folder)
    assert type(fresh) is type(original) and len(tokenizer) == original.config.vocab_size
    names = original.state_dict()
    assert set(fresh.state_dict()) == set(names) and set(loaded.state_dict()) == set(names)
    weight = "model.layers.0.mlp.up_proj.weight"
    assert fresh.state_dict()[weight].dtype == torch.float32
    assert not torch.equal(fresh.state_dict()[weight], names[weight])
    assert torch.equal(loaded.state_dict()[weight], names[weight])


def test_a_tokenizer_larger_than_the_embeddings_is_one_line(llama_folder, text_file, tmp_path, capsys):  # noqa: F811
    """Tokens added to the tokenizer without resizing the model's embeddings: one line naming both
    sizes and the fix, exit 2, instead of an IndexError in the first forward."""
    folder = tmp_path / "model"
    shutil.copytree(llama_folder, folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = transformers.AutoConfig.from_pretrained(folder).vocab_size
    tokenizer.add_tokens([f"<new{i}>" for i in range(rows - len(tokenizer) + 2)], special_tokens=True)
    tokenizer.save_pretrained(folder)
    assert main(["train", "--model", str(folder), "--dataset", str(text_file), "--max-steps", "1",
                 "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hputrain: error: --model {folder}: its tokenizer has {rows + 2} tokens and the model "
                   f"embeds {rows}: resize the embeddings to the tokenizer "
                   "(model.resize_token_embeddings(len(tokenizer))) and save the folder again"), err
