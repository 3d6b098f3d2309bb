"""Issue 24: `hputrain train` and `hputrain evaluate` on chat and instruction data (SFT), in-process
through `hputrain.cli.main`, on a tiny Llama with a ChatML template. The reference numbers are
computed here with the model called on one example at a time, no mask and no packing."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ...hf_fixtures import llama_folder, tiny_llama_config, tiny_tokenizer  # noqa: F401

transformers = pytest.importorskip("transformers", reason="the Hugging Face recipe needs transformers")

from hputrain.cli import main  # noqa: E402
from hputrain.data import sft  # noqa: E402

TEMPLATES = Path(__file__).parents[2] / "chat_templates"
BLOCK = "256"  # two or three examples a block
QUESTIONS = ["the quick brown fox?", "a stitch in time?", "to be or not?", "def add(a, b):"]
ANSWERS = ["jumps over the lazy dog", "saves nine", "that is the question", "return a + b"]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny Llama whose tokenizer knows ChatML's markers and carries the tagged ChatML template."""
    folder = tmp_path_factory.mktemp("chat-llama")
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = (TEMPLATES / "chatml_tagged.jinja").read_text()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(len(tokenizer), max_position_embeddings=256)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def conversation(i: int) -> list[dict]:
    k = i % len(QUESTIONS)
    turns = [{"role": "user", "content": f"{i}: {QUESTIONS[k]}"},
             {"role": "assistant", "content": ANSWERS[k]}]
    if i % 3 == 0:  # some with a system prompt and a second turn: examples of different lengths
        turns = ([{"role": "system", "content": "be brief"}] + turns
                 + [{"role": "user", "content": "again"}, {"role": "assistant", "content": ANSWERS[k - 1]}])
    return turns


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def chat_rows() -> list[dict]:
    return [{"messages": conversation(i)} for i in range(14)]


@pytest.fixture(scope="module")
def completion_rows() -> list[dict]:
    return [{"prompt": f"{i}: {QUESTIONS[i % 4]} ", "completion": ANSWERS[i % 4]} for i in range(10)]


def reference_loss(folder: Path, rows: list[dict], template: Path | None = None) -> tuple[float, int]:
    """(summed cross-entropy over every learned token / their number, that number): each example
    by itself through the model, its labels from data/sft.py."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if template is not None:
        tokenizer.chat_template = template.read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    examples, _ = sft.encode_rows(rows, tokenizer)
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            logits = model(torch.tensor([example["input_ids"]])).logits[0, :-1]
            targets = torch.tensor(example["labels"][1:])
            total += torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum").item()
            count += int((targets != -100).sum())
    return total / count, count


def evaluate(capsys, model, dataset, *argv) -> dict:
    assert main(["evaluate", "--model", str(model), "--dataset", str(dataset), "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# -- evaluate: packed = unpacked = one example at a time ------------------------------------------

@pytest.mark.parametrize("template", [None, "chatml.jinja"], ids=["tagged", "untagged"])
def test_evaluate_packed_equals_unpacked_equals_per_example(tmp_path, capsys, chat_model, chat_rows,
                                                             template):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    extra = ["--chat-template", str(TEMPLATES / template)] if template else []
    expected, count = reference_loss(chat_model, chat_rows, TEMPLATES / template if template else None)
    packed = evaluate(capsys, chat_model, data, "--block-size", BLOCK, *extra)
    unpacked = evaluate(capsys, chat_model, data, "--block-size", BLOCK, "--no-packing", *extra)
    assert packed["method"] == unpacked["method"] == "messages"
    assert packed["eval_tokens"] == unpacked["eval_tokens"] == count
    assert packed["eval_loss"] == pytest.approx(expected, abs=1e-5)
    assert unpacked["eval_loss"] == pytest.approx(expected, abs=1e-5)
    assert packed["eval_perplexity"] == pytest.approx(torch.tensor(expected).exp().item(), rel=1e-5)


def test_tagged_and_untagged_templates_count_the_same_tokens(tmp_path, capsys, chat_model, chat_rows):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    tagged = evaluate(capsys, chat_model, data, "--block-size", BLOCK)
    untagged = evaluate(capsys, chat_model, data, "--block-size", BLOCK,
                        "--chat-template", str(TEMPLATES / "chatml.jinja"))
    assert tagged["eval_tokens"] == untagged["eval_tokens"]
    assert tagged["eval_loss"] == pytest.approx(untagged["eval_loss"], abs=1e-6)


def test_evaluate_prompt_completion_counts_the_completion(tmp_path, capsys, chat_model, completion_rows):
    data = write_jsonl(tmp_path / "pc.jsonl", completion_rows)
    expected, count = reference_loss(chat_model, completion_rows)
    packed = evaluate(capsys, chat_model, data, "--block-size", BLOCK)
    unpacked = evaluate(capsys, chat_model, data, "--block-size", BLOCK, "--no-packing")
    assert packed["method"] == "prompt_completion"
    assert packed["eval_tokens"] == unpacked["eval_tokens"] == count
    assert packed["eval_loss"] == pytest.approx(expected, abs=1e-5)
    assert unpacked["eval_loss"] == pytest.approx(expected, abs=1e-5)
    everything = evaluate(capsys, chat_model, data, "--block-size", BLOCK, "--no-completion-only-loss")
    assert everything["eval_tokens"] > count


def test_a_folder_of_chat_shards_evaluates_as_the_same_rows_in_one_file(tmp_path, capsys, chat_model,
                                                                       chat_rows):
    """Issue 39 item 12: a folder of .jsonl shards (no --streaming) is read by its files' kind,
    as chat rows, and gives the tokens and loss of one file of the same rows, which equal the
    reference's (each example by itself); it was read as plain text, JSON and all."""
    one = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    (tmp_path / "shards").mkdir()
    for k in range(3):
        write_jsonl(tmp_path / "shards" / f"chat-{k:02d}.jsonl", chat_rows[k * 5:(k + 1) * 5])
    expected, count = reference_loss(chat_model, chat_rows)
    whole = evaluate(capsys, chat_model, one, "--block-size", BLOCK)
    shards = evaluate(capsys, chat_model, tmp_path / "shards", "--block-size", BLOCK)
    assert shards["method"] == whole["method"] == "messages"
    assert shards["eval_tokens"] == whole["eval_tokens"] == count
    assert shards["eval_loss"] == whole["eval_loss"] == pytest.approx(expected, abs=1e-5)


def test_evaluate_text_and_lines(tmp_path, capsys, chat_model):
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    assert main(["evaluate", "--model", str(chat_model), "--dataset", str(data), "--block-size", "32"]) == 0
    lines = dict(line.split(" ", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert lines["method"] == "text"
    assert int(lines["eval_tokens"]) % 31 == 0  # every token of each block but its first
    assert float(lines["eval_perplexity"]) == pytest.approx(torch.tensor(float(lines["eval_loss"])).exp().item(), rel=1e-5)


def test_evaluate_caches_in_cache_dir_and_never_in_the_model_folder(tmp_path, capsys, chat_model,
                                                                   chat_rows):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    model_files = sorted(chat_model.rglob("*"))
    cache = tmp_path / "cache"
    first = evaluate(capsys, chat_model, data, "--block-size", BLOCK, "--cache-dir", str(cache))
    (cached,) = cache.glob("sft-*/")
    written = cached.stat().st_mtime_ns
    again = evaluate(capsys, chat_model, data, "--block-size", BLOCK, "--cache-dir", str(cache))
    assert cached.stat().st_mtime_ns == written  # read back, not written again
    scratch = evaluate(capsys, chat_model, data, "--block-size", BLOCK)  # a temporary cache
    assert first == again == scratch
    assert sorted(chat_model.rglob("*")) == model_files
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    assert "default: a temporary folder" in " ".join(capsys.readouterr().out.split())


# -- train ----------------------------------------------------------------------------------------

@pytest.mark.ci  # 15-25 s on two shared cores: slow, but the end-to-end check of the feature
def test_train_on_conversations_names_the_method_and_lowers_the_loss(tmp_path, capsys, chat_model,
                                                                      chat_rows):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows * 2)
    out = tmp_path / "run"
    assert main(["train", "--model", str(chat_model), "--dataset", str(data), "--output-dir", str(out),
                 "--precision", "32", "--block-size", BLOCK, "--per-device-train-batch-size", "2",
                 "--max-steps", "24", "--learning-rate", "3e-3", "--disable-tqdm",
                 "--logging-steps", "8", "--save-steps", "-1"]) == 0
    stdout = capsys.readouterr().out
    assert "method: SFT on conversations ('messages')" in stdout
    assert "loss on assistant turns" in stdout and "28 rows, 0 skipped" in stdout
    final = out / "final"
    saved = transformers.AutoTokenizer.from_pretrained(final)
    assert saved.chat_template == (TEMPLATES / "chatml_tagged.jinja").read_text()
    before = evaluate(capsys, chat_model, data, "--block-size", BLOCK)["eval_loss"]
    after = evaluate(capsys, final, data, "--block-size", BLOCK)["eval_loss"]
    assert after < before - 0.5, (before, after)


def test_chat_template_flag_is_the_one_saved_in_final(tmp_path, capsys, chat_model, chat_rows):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    out = tmp_path / "run"
    assert main(["train", "--model", str(chat_model), "--dataset", str(data), "--output-dir", str(out),
                 "--precision", "32", "--block-size", BLOCK, "--max-steps", "1", "--disable-tqdm",
                 "--save-steps", "-1", "--no-packing", "--no-assistant-only-loss",
                 "--chat-template", str(TEMPLATES / "chatml.jinja")]) == 0
    stdout = capsys.readouterr().out
    assert "loss on every token (--no-assistant-only-loss)" in stdout and "unpacked (--no-packing)" in stdout
    # 14 rows, 5% held out: one example, so one row (never "1 rows")
    assert "13 training rows and 1 validation row of at most 256 tokens" in stdout, stdout
    assert "(--validation-split-percentage), 1 row\n" in stdout + "\n", stdout
    saved = transformers.AutoTokenizer.from_pretrained(out / "final")
    assert saved.chat_template == (TEMPLATES / "chatml.jinja").read_text()


def test_the_encoded_examples_are_cached(tmp_path, capsys, chat_model, chat_rows):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    argv = ["train", "--model", str(chat_model), "--dataset", str(data), "--output-dir", str(tmp_path / "run"),
            "--precision", "32", "--block-size", BLOCK, "--max-steps", "1", "--disable-tqdm",
            "--save-steps", "-1", "--per-device-train-batch-size", "2"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "(cached in" in stdout
    assert re.search(r"\d+ training blocks and 1 validation block of 256 tokens, packed", stdout), \
        stdout
    assert "(--validation-split-percentage), 1 block\n" in stdout + "\n", stdout
    assert main(argv + ["--overwrite-output-dir"]) == 0
    assert "(from the cache" in capsys.readouterr().out
    assert main(argv + ["--no-assistant-only-loss", "--overwrite-output-dir"]) == 0  # another key
    assert "(cached in" in capsys.readouterr().out


# -- bad input: one line, exit 2 ------------------------------------------------------------------

@pytest.mark.parametrize("rows, words", [
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
      {"other": 1}], "no messages"),
    ([{"messages": [{"role": "wizard", "content": "hi"}]}], "wizard"),
    ([{"messages": []}], "empty"),
    ([{"colour": "red"}], "'messages'"),
], ids=["no-messages", "unknown-role", "empty-conversation", "no-known-column"])
def test_a_bad_row_is_one_line(tmp_path, capsys, chat_model, rows, words):
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    for command in (["train", "--output-dir", str(tmp_path / "run")], ["evaluate"]):
        err = error_line(capsys, [*command, "--model", str(chat_model), "--dataset", str(data)])
        assert words in err and "bad.jsonl" in err, err


@pytest.mark.parametrize("name", ["bad.jsonl", "bad.bin"])
def test_a_binary_file_is_one_line(tmp_path, capsys, chat_model, name):
    data = tmp_path / name
    data.write_bytes(bytes(range(256)) * 4)
    err = error_line(capsys, ["evaluate", "--model", str(chat_model), "--dataset", str(data)])
    assert "not text" in err or "not UTF-8" in err, err


def test_a_tokenizer_without_a_template_is_one_line_naming_the_flag(tmp_path, capsys, llama_folder,  # noqa: F811
                                                                     chat_rows):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    for command in (["train", "--output-dir", str(tmp_path / "run")], ["evaluate"]):
        err = error_line(capsys, [*command, "--model", str(llama_folder), "--dataset", str(data)])
        assert "no chat template" in err and "--chat-template" in err, err


# -- the mask on the forward path -----------------------------------------------------------------

def test_packed_inputs_build_the_mask_in_the_compute_dtype_and_drop_seq_lens():
    from hputrain.execution.precision import BF16Autocast, Precision
    from hputrain.training.packed import PackedInputs

    model = torch.nn.Linear(2, 2)
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "seq_lens": torch.tensor([[3, 1, 0, 0]])}
    inputs = frozenset({"input_ids", "attention_mask", "position_ids", "labels"})
    fp32 = PackedInputs(model, Precision(), inputs)(batch)
    bf16 = PackedInputs(model, BF16Autocast("cpu"), inputs)(batch)
    assert "seq_lens" not in fp32 and "seq_lens" in batch  # the batch itself is left as it was
    assert fp32["attention_mask"].dtype == torch.float32 and bf16["attention_mask"].dtype == torch.bfloat16
    allowed = fp32["attention_mask"][0, 0] == 0
    assert allowed.tolist() == [[True, False, False, False], [True, True, False, False],
                                [True, True, True, False], [False, False, False, True]]
    assert PackedInputs(model, Precision(), inputs)({"input_ids": 1}) == {"input_ids": 1}
    with pytest.raises(Exception, match="--no-packing"):
        PackedInputs(model, Precision(), frozenset({"input_ids"}))(batch)
