"""Issue 30, items 1, 12 and 8: PEFT adapters with the rest of hputrain.

- LoRA trains on packed chat blocks (the default packing): the Trainer reads the base model's
  forward and loss, never PEFT's wrapper, so position_ids reach the model, the token count is the
  plain model's, and a packed step's loss is the per-example loss of the PEFT model itself.
- A LoRA run's final/ (an adapter folder) is taken wherever a model folder is: evaluate, generate,
  --ref-model, --model to train on; `hputrain export --merge` writes one merged model folder.
- evaluate takes train's --bf16 / --no-bf16 and says what cutting to the block size dropped.

References are PEFT and transformers loading the same folders, and the model called on one
example at a time (test_sft_recipe.reference_loss's way).
"""
from __future__ import annotations

import json

import pytest
import torch

from ..methods.sft.test_sft_recipe import (TEMPLATES, chat_model, chat_rows, conversation,  # noqa: F401
                              error_line, write_jsonl)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

import hputrain  # noqa: E402
from hputrain import Trainer, TrainingArguments  # noqa: E402
from hputrain.cli import main  # noqa: E402
from hputrain.data import sft  # noqa: E402
from hputrain.training.loss import TokenCount  # noqa: E402

BLOCK = 256


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def base_and_tokenizer(folder):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, tokenizer


def with_lora(model, seed: int = 1):
    """LoRA adapters whose B is not zero (peft starts B at zero, which would hide the adapters)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def per_example_loss(model, tokenizer, rows) -> tuple[float, int]:
    """Summed cross-entropy over every learned token / their number: each example alone."""
    examples, _ = sft.encode_rows(rows, tokenizer)
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            logits = model(input_ids=torch.tensor([example["input_ids"]])).logits[0, :-1]
            targets = torch.tensor(example["labels"][1:])
            total += torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum").item()
            count += int((targets != -100).sum())
    return total / count, count


# -- item 1: LoRA on packed blocks ------------------------------------------------------------------

def test_the_token_count_is_the_same_with_and_without_adapters(chat_model):  # noqa: F811
    plain = TokenCount(base_and_tokenizer(chat_model)[0])
    lora = TokenCount(with_lora(base_and_tokenizer(chat_model)[0]))
    assert plain.takes_item_count and plain.shifts_labels  # a Llama: transformers' causal loss
    assert (lora.takes_item_count, lora.shifts_labels) == (plain.takes_item_count, plain.shifts_labels)
    labels = torch.tensor([[-100, 5, 6, -100, 7]])
    assert lora({"labels": labels}) == plain({"labels": labels}) == 3  # after the shift


def test_a_lora_step_on_packed_blocks_is_the_per_example_loss(tmp_path, chat_model, chat_rows,  # noqa: F811
                                                              monkeypatch):
    model, tokenizer = base_and_tokenizer(chat_model)
    model = with_lora(model)
    expected, _ = per_example_loss(model.eval(), tokenizer, chat_rows)
    data = hputrain.sft_dataset(datasets.Dataset.from_list(chat_rows), tokenizer, BLOCK)
    assert "position_ids" in data[0] and len(data) < len(chat_rows)  # several examples a block
    seen = []  # what reaches the base model's forward
    forward = type(model.get_base_model()).forward

    def spy(self, *args, **kwargs):
        seen.append(sorted(kwargs))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model.get_base_model()), "forward", spy)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=len(data),
                             max_steps=2, logging_steps=1, learning_rate=1e-3, precision="fp32",
                             save_steps=0, report_to="none", disable_tqdm=True, accelerator="cpu")
    Trainer(model, args, train_dataset=data).train()
    logs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in logs if "loss" in row]
    assert losses[0] == pytest.approx(expected, abs=1e-5)  # step 1: the whole data set
    assert losses[1] < losses[0]
    assert {"attention_mask", "position_ids", "num_items_in_batch"} <= set(seen[0])


# -- item 12: a LoRA run's final/ wherever a model folder is taken ---------------------------------

def train_cli(*argv) -> int:
    return main(["train", "--precision", "32", "--block-size", str(BLOCK), "--disable-tqdm",
                 "--save-steps", "-1", "--validation-split-percentage", "0", *argv])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, chat_model, chat_rows):  # noqa: F811
    """A LoRA run on chat rows with the default packing, started with a relative --model path
    from its own working directory: (final/, the data file)."""
    where = tmp_path_factory.mktemp("lora-run")
    data = write_jsonl(where / "chat.jsonl", chat_rows)
    (where / "models").symlink_to(chat_model.parent)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HPUTRAIN_ACCELERATOR", "cpu")
        patch.chdir(where)
        assert train_cli("--model", f"models/{chat_model.name}", "--dataset", "chat.jsonl",
                         "--lora-r", "4", "--output-dir", "run", "--max-steps", "3",
                         "--learning-rate", "1e-2", "--per-device-train-batch-size", "2") == 0
    return where / "run" / "final", data


def test_lora_trains_on_packed_chat_blocks_from_the_command_line(lora_run):
    final, _ = lora_run
    run = final.parent
    assert json.loads((run / "recipe.json").read_text())["recipe"]["packing"] is True  # the default
    losses = [row["loss"] for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "loss" in row]
    assert losses and all(loss == loss and loss < 100 for loss in losses)  # finite
    assert (final / "adapter_model.safetensors").is_file()


def peft_reference(chat_model, final):  # noqa: F811
    """The run's adapters on the base, as PEFT loads them (the reference of every test here)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, final).eval()


def test_train_writes_the_base_as_an_absolute_path(lora_run, chat_model):  # noqa: F811
    final, _ = lora_run
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(chat_model.resolve())  # typed: models/NAME
    assert not (final / "config.json").exists()  # an adapter folder, not a model folder
    assert (final / "tokenizer_config.json").is_file()


def test_evaluate_an_adapter_folder_from_another_directory(lora_run, chat_model, chat_rows, tmp_path,  # noqa: F811
                                                           capsys, monkeypatch):
    final, data = lora_run
    model = peft_reference(chat_model, final)
    expected, count = per_example_loss(model, transformers.AutoTokenizer.from_pretrained(final),
                                       chat_rows)
    monkeypatch.chdir(tmp_path)
    assert main(["evaluate", "--model", str(final), "--dataset", str(data), "--json",
                 "--block-size", str(BLOCK)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval_tokens"] == count
    assert result["eval_loss"] == pytest.approx(expected, abs=1e-5)
    with model.disable_adapter():
        base_loss, _ = per_example_loss(model, transformers.AutoTokenizer.from_pretrained(final),
                                        chat_rows)
    assert abs(base_loss - expected) > 1e-3  # the adapters are in the number


def test_generate_with_an_adapter_folder_answers_as_peft_does(lora_run, chat_model, tmp_path,  # noqa: F811
                                                               capsys, monkeypatch):
    from hputrain.recipes.hf.chat import stop_token_ids

    final, _ = lora_run
    model = peft_reference(chat_model, final)
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    question = "the quick brown fox?"
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, return_dict=True,
                                            return_tensors="pt")
    stops = stop_token_ids(tokenizer, model.generation_config.eos_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                             max_new_tokens=12, do_sample=False, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id)
    expected = out[0, encoded["input_ids"].shape[1]:].tolist()
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", str(final), "--chat", question, "--max-new-tokens", "12",
                 "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["tokens"] == len(expected)
    assert answer["text"] == tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_export_merge_writes_one_model_folder_with_the_peft_models_logits(lora_run, chat_model,  # noqa: F811
                                                                          tmp_path, capsys):
    final, _ = lora_run
    out = tmp_path / "merged"
    assert main(["export", "--merge", str(final), "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    ids = torch.tensor([[1, 5, 9, 40, 77, 120, 33, 2]])
    with torch.no_grad():
        expected = peft_reference(chat_model, final)(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-5)
        base = transformers.AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
        assert not torch.allclose(base(input_ids=ids).logits, expected, atol=1e-3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == transformers.AutoTokenizer.from_pretrained(final).chat_template


def test_an_adapter_folder_is_a_reference_model(lora_run, chat_model):  # noqa: F811
    from hputrain.recipes.hf import load_model, model_folder

    final, _ = lora_run
    folder = model_folder(str(final), flag="--ref-model")
    reference, _ = load_model(folder, flag="--ref-model", merge=True)
    assert isinstance(reference, transformers.LlamaForCausalLM)  # merged: no adapters to disable
    ids = torch.tensor([[1, 5, 9, 40, 77, 120]])
    with torch.no_grad():
        expected = peft_reference(chat_model, final)(input_ids=ids).logits
        assert torch.allclose(reference.eval()(input_ids=ids).logits, expected, atol=1e-5)


def test_training_continues_on_an_adapter_folder(lora_run, tmp_path, capsys):
    from safetensors.torch import load_file

    final, data = lora_run
    assert train_cli("--model", str(final), "--dataset", str(data), "--output-dir",
                     str(tmp_path / "more"), "--max-steps", "1", "--learning-rate", "1e-3",
                     "--per-device-train-batch-size", "2") == 0
    assert "+ LoRA r=4" in capsys.readouterr().out
    before = load_file(final / "adapter_model.safetensors")
    after = load_file(tmp_path / "more" / "final" / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    lora_b = [name for name in before if "lora_B" in name]
    change = sum((after[n] - before[n]).norm() for n in lora_b)
    assert 0 < change < 0.5 * sum(before[n].norm() for n in lora_b)  # trained on, not started over


def test_an_adapter_whose_base_is_gone_is_one_line_and_base_model_wins(lora_run, chat_model,  # noqa: F811
                                                                       tmp_path, capsys):
    import shutil

    final, data = lora_run
    moved = shutil.copytree(final, tmp_path / "final")
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    line = error_line(capsys, ["evaluate", "--model", str(moved), "--dataset", str(data)])
    assert str(tmp_path / "gone") in line and "--base-model" in line
    line = error_line(capsys, ["export", "--merge", str(moved), "--output", str(tmp_path / "m")])
    assert "--base-model" in line
    assert main(["evaluate", "--model", str(moved), "--dataset", str(data), "--json",
                 "--block-size", str(BLOCK), "--base-model", str(chat_model)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval_tokens"] > 0


# -- item 8: evaluate's precision flags and what the block size cut ---------------------------------

def evaluated(capsys, *argv) -> tuple[dict, str]:
    assert main(["evaluate", "--json", *argv]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_evaluate_takes_trains_bf16_flags(tmp_path, capsys, chat_model, chat_rows):  # noqa: F811
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    common = ["--model", str(chat_model), "--dataset", str(data), "--block-size", str(BLOCK)]
    fp32, _ = evaluated(capsys, *common)
    no_bf16, _ = evaluated(capsys, *common, "--no-bf16")
    bf16, _ = evaluated(capsys, *common, "--bf16")
    spelled, _ = evaluated(capsys, *common, "--precision", "bf16")
    decided, _ = evaluated(capsys, *common, "--bf16", "--precision", "fp32")  # as train: precision wins
    assert no_bf16 == fp32 == decided
    assert bf16 == spelled
    assert bf16["eval_loss"] != fp32["eval_loss"]  # bfloat16 autocast did run
    assert bf16["eval_loss"] == pytest.approx(fp32["eval_loss"], abs=0.05)


def test_evaluate_says_how_many_examples_and_tokens_the_block_size_cut(tmp_path, capsys, chat_model,  # noqa: F811
                                                                      chat_rows):  # noqa: F811
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)
    lengths = [len(e["input_ids"]) for e in sft.encode_rows(chat_rows, tokenizer)[0]]
    short = 48
    assert max(lengths) <= BLOCK and sum(n > short for n in lengths) > 0
    whole, err = evaluated(capsys, "--model", str(chat_model), "--dataset", str(data),
                           "--block-size", str(BLOCK))
    assert (whole["examples_cut"], whole["tokens_cut"]) == (0, 0) and "cut" not in err
    for packing in ([], ["--no-packing"]):
        cut, err = evaluated(capsys, "--model", str(chat_model), "--dataset", str(data),
                             "--block-size", str(short), *packing)
        assert cut["examples_cut"] == sum(n > short for n in lengths)
        assert cut["tokens_cut"] == whole["eval_tokens"] - cut["eval_tokens"] > 0
        assert (f"{cut['examples_cut']} examples were longer than --block-size {short}" in err
                and f"{cut['tokens_cut']:,} of {whole['eval_tokens']:,} counted tokens" in err), err
    assert main(["evaluate", "--model", str(chat_model), "--dataset", str(data),
                 "--block-size", str(short)]) == 0
    lines = dict(line.split(" ", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert int(lines["examples_cut"]) == cut["examples_cut"]
