"""Issue 32, item 11: reward-model training. The reference is TRL 1.16's RewardTrainer on the same
model and rows (its tokenization, its compute_loss and the metrics it logs); then `hputrain train
--method reward` end to end, full and LoRA, and a short run that learns its pairs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ...hf_fixtures import lazy_rehearses_hf_models, tiny_llama_folder

transformers = pytest.importorskip("transformers", reason="reward models are Hugging Face models")

from hputrain.cli import main  # noqa: E402
from hputrain.methods.reward.config import RewardConfig  # noqa: E402
from hputrain.methods.reward.trainer import RewardTrainer, encode_reward_pairs, reward_loss  # noqa: E402

TEMPLATES = Path(__file__).parents[2] / "chat_templates"
PROMPTS = ["the quick brown", "to be or", "a stitch in time", "def add(a, b):", "a penny saved",
           "that is the"]
CHOSEN = [" fox jumps", " not to be", " saves nine", "\n    return a + b", " is a penny earned",
          " question"]
REJECTED = [" dog sleeps over", " maybe", " is late and slow", " pass", " is lost", " answer, no"]
MARGINS = [0.5, 0.0, 1.5, -0.25, 2.0, 0.75]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny causal-LM Llama folder, and the same weights saved as a sequence classifier with a
    score head drawn once (so that every load of it scores alike)."""
    root = tmp_path_factory.mktemp("reward-models")
    causal = tiny_llama_folder(root / "causal", seed=0)
    torch.manual_seed(5)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(causal, num_labels=1)
    model.save_pretrained(root / "reward")
    transformers.AutoTokenizer.from_pretrained(causal).save_pretrained(root / "reward")
    return {"causal": causal, "reward": root / "reward"}


def text_rows(n: int = 6, margin: bool = False, prompt: bool = True) -> list[dict]:
    rows = []
    for i in range(n):
        row = ({"prompt": PROMPTS[i % 6], "chosen": CHOSEN[i % 6], "rejected": REJECTED[i % 6]}
               if prompt else {"chosen": PROMPTS[i % 6] + CHOSEN[i % 6],
                               "rejected": PROMPTS[i % 6] + REJECTED[i % 6]})
        rows.append(row | ({"margin": MARGINS[i % 6]} if margin else {}))
    return rows


def chat_rows(n: int = 4) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": PROMPTS[i]}],
             "chosen": [{"role": "assistant", "content": CHOSEN[i].strip()}],
             "rejected": [{"role": "assistant", "content": REJECTED[i].strip()}]} for i in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(folder: Path):
    return transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()


def tokenizer_of(folder: Path, template: str | None = None):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if template:
        tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


def scores(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """Each text's score, the model called on it alone (no padding)."""
    with torch.no_grad():
        return torch.stack([model(**tokenizer(text, return_tensors="pt")).logits[0, 0]
                            for text in texts])


# -- as TRL's RewardTrainer ------------------------------------------------------------------------

def trl_trainer(folder: Path, rows: list[dict], tmp_path: Path, template: str | None = None, **config):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                            **config)
    return trl.RewardTrainer(load(folder), args=args, processing_class=tokenizer_of(folder, template),
                             train_dataset=datasets.Dataset.from_list(rows))


@pytest.mark.parametrize("shape", ["text", "implicit_text", "chat", "margin"])
def test_rows_are_tokenized_as_trl_tokenizes_them(folders, tmp_path, shape):
    template = "chatml.jinja" if shape == "chat" else None
    rows = (chat_rows() if shape == "chat" else
            text_rows(prompt=shape != "implicit_text", margin=shape == "margin"))
    theirs = trl_trainer(folders["reward"], rows, tmp_path, template).train_dataset
    ours, stats = encode_reward_pairs(((str(i), r) for i, r in enumerate(rows)),
                                      tokenizer_of(folders["reward"], template))
    keys = ("chosen_ids", "rejected_ids") + (("margin",) if shape == "margin" else ())
    assert ours == [{k: row[k] for k in keys} for row in theirs]
    assert stats.pairs == len(rows) and stats.too_long == 0


def test_max_length_leaves_out_the_pairs_trl_filters(folders, tmp_path):
    rows = text_rows() + [{"prompt": "the quick brown fox " * 6, "chosen": " yes", "rejected": " no"}]
    theirs = trl_trainer(folders["reward"], rows, tmp_path, max_length=16).train_dataset
    ours, stats = encode_reward_pairs(((str(i), r) for i, r in enumerate(rows)),
                                      tokenizer_of(folders["reward"]), max_length=16)
    assert [p["chosen_ids"] for p in ours] == [row["chosen_ids"] for row in theirs]
    assert stats.too_long == len(rows) - len(ours) >= 1


def our_metrics(folder: Path, rows: list[dict], tmp_path: Path, **config) -> dict:
    args = RewardConfig(output_dir=str(tmp_path / "ours"), per_device_eval_batch_size=len(rows),
                        report_to="none", disable_tqdm=True, **config)
    trainer = RewardTrainer(load(folder), args, processing_class=tokenizer_of(folder),
                            train_dataset=rows)
    return trainer.evaluate(rows)


@pytest.mark.parametrize("margin, center", [(False, None), (False, 0.01), (True, None), (True, 0.3)])
def test_loss_and_metrics_equal_trl_reward_trainer(folders, tmp_path, margin, center):
    rows = text_rows(margin=margin)
    trainer = trl_trainer(folders["reward"], rows, tmp_path, center_rewards_coefficient=center)
    encoded = [dict(row) for row in trainer.train_dataset]
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(encoded)).item()
    theirs = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    ours = our_metrics(folders["reward"], rows, tmp_path, center_rewards_coefficient=center)
    assert ours["eval_loss"] == pytest.approx(loss, abs=1e-5)
    for name in ("min_reward", "mean_reward", "max_reward", "accuracy", "margin"):
        assert ours[f"eval_{name}"] == pytest.approx(theirs[name], abs=1e-5), name
    assert 0 < theirs["accuracy"] < 1  # the model orders some pairs each way: a real check
    assert "eval_perplexity" not in ours


def test_the_loss_is_the_formula_on_scores_of_unpadded_sequences(folders, tmp_path):
    """Scores of each sequence alone, the formula written out: padding to a bucket (and the
    chosen-then-rejected batch) changes nothing."""
    rows = text_rows(margin=True)
    tokenizer, model = tokenizer_of(folders["reward"]), load(folders["reward"])
    chosen = scores(model, tokenizer, [r["prompt"] + r["chosen"] + "</s>" for r in rows])
    rejected = scores(model, tokenizer, [r["prompt"] + r["rejected"] + "</s>" for r in rows])
    margin = torch.tensor(MARGINS)
    expected = (torch.log1p(torch.exp(-(chosen - rejected - margin))).mean()
                + 0.1 * ((chosen + rejected) ** 2).mean())
    assert reward_loss(chosen, rejected, margin, 0.1).item() == pytest.approx(expected.item(), abs=1e-6)
    ours = our_metrics(folders["reward"], rows, tmp_path, center_rewards_coefficient=0.1)
    assert ours["eval_loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert ours["eval_margin"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)
    assert ours["eval_min_reward"] == pytest.approx(torch.cat([chosen, rejected]).min().item(), abs=1e-5)


# -- training --------------------------------------------------------------------------------------

def test_training_raises_the_accuracy_on_its_pairs(folders, tmp_path):
    rows = text_rows()
    args = RewardConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=6,
                        per_device_eval_batch_size=6, learning_rate=3e-3, max_steps=12,
                        logging_steps=4, report_to="none", disable_tqdm=True, eval_steps=0,
                        save_steps=-1)
    trainer = RewardTrainer(load(folders["reward"]), args, processing_class=tokenizer_of(folders["reward"]),
                            train_dataset=rows, eval_dataset=rows)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert before["eval_accuracy"] < 1 and after["eval_accuracy"] == 1.0
    assert after["eval_loss"] < before["eval_loss"] - 0.2
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in logged if "accuracy" in r]
    assert [r["step"] for r in training] == [4, 8, 12]
    tokens = sum(len(p["chosen_ids"]) + len(p["rejected_ids"])
                 for p in encode_reward_pairs(((str(i), r) for i, r in enumerate(rows)),
                                              tokenizer_of(folders["reward"]))[0])
    assert [r["num_tokens"] for r in training] == [4 * tokens, 8 * tokens, 12 * tokens]


def test_the_loss_is_a_mean_over_the_global_batch_however_it_is_split(folders, tmp_path):
    """Six pairs with margins and centring in one micro-batch, or in three of two: the same first
    loss and metrics (each micro-batch weighed by its share of the step's pairs)."""
    rows = text_rows(margin=True)
    logged = []
    for size, accumulate in ((6, 1), (2, 3)):
        out = tmp_path / f"split-{size}"
        args = RewardConfig(output_dir=str(out), per_device_train_batch_size=size,
                            gradient_accumulation_steps=accumulate, max_steps=1, logging_steps=1,
                            center_rewards_coefficient=0.2, report_to="none", disable_tqdm=True,
                            save_steps=-1)
        RewardTrainer(load(folders["reward"]), args, processing_class=tokenizer_of(folders["reward"]),
                      train_dataset=rows).train()
        logged.append(json.loads((out / "metrics.jsonl").read_text().splitlines()[0]))
    whole, split = logged
    for name in ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward", "num_tokens"):
        assert split[name] == pytest.approx(whole[name], abs=1e-5), name


def train(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    status = main(["train", "--method", "reward", *args, "--output-dir", str(out),
                   "--logging-steps", "1", "--disable-tqdm", "--precision", "fp32",
                   "--validation-split-percentage", "0", "--per-device-train-batch-size", "6"])
    assert status == 0
    return out


def test_cli_trains_a_reward_model_that_loads(folders, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(margin=True))
    out = train(tmp_path, "full", "--model", str(folders["reward"]), "--dataset", str(data),
                "--max-steps", "3", "--learning-rate", "1e-3")
    header = capsys.readouterr().out
    assert "reward model on preference pairs" in header
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(name in logged[0] for name in ("loss", "accuracy", "margin", "num_tokens"))
    tokenizer = tokenizer_of(out / "final")
    texts = [r["prompt"] + r["chosen"] for r in text_rows()]
    trained = transformers.AutoModelForSequenceClassification.from_pretrained(out / "final")
    assert trained.config.num_labels == 1 and trained.config.pad_token_id == tokenizer.pad_token_id
    before, after = (scores(m, tokenizer, texts) for m in (load(folders["reward"]), trained))
    assert (after - before).abs().max() > 1e-3


def test_cli_gives_a_causal_lm_folder_a_score_head(folders, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    out = train(tmp_path, "causal", "--model", str(folders["causal"]), "--dataset", str(data),
                "--max-steps", "1")
    assert "new score head" in capsys.readouterr().out
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "final")
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # PEFT's read
def test_cli_trains_lora_adapters_and_the_score_head(folders, tmp_path):
    peft = pytest.importorskip("peft")
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    out = train(tmp_path, "lora", "--model", str(folders["reward"]), "--dataset", str(data),
                "--max-steps", "3", "--lora-r", "4", "--learning-rate", "1e-2")
    saved = peft.PeftConfig.from_pretrained(out / "final")
    assert saved.task_type == "SEQ_CLS"
    from safetensors import safe_open
    with safe_open(str(out / "final" / "adapter_model.safetensors"), "pt") as handle:
        assert any("score" in key for key in handle.keys())  # the head is trained and saved
    tokenizer = tokenizer_of(folders["reward"])
    texts = [r["prompt"] + r["chosen"] for r in text_rows()]
    trained = peft.PeftModel.from_pretrained(load(folders["reward"]), out / "final").eval()
    before, after = (scores(m, tokenizer, texts) for m in (load(folders["reward"]), trained))
    assert (after - before).abs().max() > 1e-3


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # PEFT's read
def test_a_lora_reward_model_is_a_reward_function_and_merges_with_its_head(folders, tmp_path,
                                                                         capsys):
    """Issue 39, item 5: a LoRA reward model's final/ (adapters and the score head it trained, on
    a causal LM's base) scores in GRPO's reward functions as PEFT scores it, and `export --merge`
    writes a sequence classifier that keeps the trained head; as a generator, both are one line."""
    peft = pytest.importorskip("peft")
    from hputrain.methods.grpo.rewards import RewardFunctions

    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    final = train(tmp_path, "lora", "--model", str(folders["causal"]), "--dataset", str(data),
                  "--max-steps", "3", "--lora-r", "4", "--learning-rate", "1e-2") / "final"
    tokenizer = tokenizer_of(folders["causal"])
    texts = [r["prompt"] + r["chosen"] for r in text_rows()]
    reference = peft.PeftModel.from_pretrained(load(folders["causal"]), final).eval()
    expected = scores(reference, tokenizer, texts)
    rewards = RewardFunctions([str(final)])
    assert rewards.names == ["final"] and rewards.functions[0].config.num_labels == 1
    prompts = [r["prompt"] for r in text_rows()]
    ours = rewards(prompts, [r["chosen"] for r in text_rows()], [[1]] * 6, {}, step=1)[:, 0]
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)

    capsys.readouterr()
    assert main(["export", "--merge", str(final), "--output", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "LlamaForSequenceClassification"
    assert merged.config.num_labels == 1
    torch.testing.assert_close(scores(merged.eval(), tokenizer, texts), expected, rtol=0, atol=1e-5)
    merged_rewards = RewardFunctions([str(tmp_path / "merged")])
    torch.testing.assert_close(merged_rewards(prompts, [r["chosen"] for r in text_rows()],
                                              [[1]] * 6, {}, step=1)[:, 0], expected, rtol=0, atol=1e-5)
    for folder in (final, tmp_path / "merged"):  # a scorer does not generate
        capsys.readouterr()
        assert main(["generate", "--cpu", "--model", str(folder), "--chat", "hi"]) == 2
        err = capsys.readouterr().err
        assert "sequence classifier" in err and "does not generate" in err and "Traceback" not in err

    # as --model of --method reward, a LoRA reward model's final/ is trained on further, as a
    # model folder is: its adapters and its head (not refused as "an adapter folder")
    more = train(tmp_path, "more", "--model", str(final), "--dataset", str(data), "--max-steps",
                 "2", "--learning-rate", "1e-2") / "final"
    assert peft.PeftConfig.from_pretrained(more).task_type == "SEQ_CLS"
    further = peft.PeftModel.from_pretrained(load(folders["causal"]), more).eval()
    assert (scores(further, tokenizer, texts) - expected).abs().max() > 1e-4
    causal = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folders["causal"]),
                                 peft.LoraConfig(task_type="CAUSAL_LM", r=2))
    causal.peft_config["default"].base_model_name_or_path = str(folders["causal"])
    causal.save_pretrained(tmp_path / "causal-adapters")
    capsys.readouterr()
    assert main(["train", "--method", "reward", "--model", str(tmp_path / "causal-adapters"),
                 "--dataset", str(data), "--output-dir", str(tmp_path / "no")]) == 2
    assert "holds LoRA adapters of a causal language model" in capsys.readouterr().err


@lazy_rehearses_hf_models
def test_lazy_mode_compiles_nothing_after_warm_up(folders, tmp_path):
    """Pairs padded to a few static lengths, metrics summed on the device: after the warm-up
    steps no step compiles a new graph (the logging steps read their sums back outside it)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(12, margin=True))
    out = train(tmp_path, "lazy", "--model", str(folders["reward"]), "--dataset", str(data),
                "--max-steps", "6", "--per-device-train-batch-size", "2", "--execution-mode", "lazy",
                "--throughput-warmup-steps", "2", "--logging-steps", "3",
                "--center-rewards-coefficient", "0.01")
    summary = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if "graph_compiles" in line][-1]
    assert summary["graph_compiles"] > 0  # lazy mode really ran
    assert summary["graph_compiles_after_warmup"] == 0


def launch(tmp_path: Path, name: str, *args: str) -> list[dict]:
    import subprocess
    import sys

    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu", "--method",
                           "reward", *args, "--output-dir", str(out), "--logging-steps", "1",
                           "--disable-tqdm", "--validation-split-percentage", "0", "--precision",
                           "fp32"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    (tmp_path / f"{name}.stdout").write_text(proc.stdout)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.mark.slow
def test_two_processes_train_as_one_with_the_same_global_batch(folders, tmp_path):
    """2 processes x 2 pairs equal 1 process x 4 pairs: the loss, and the metrics every rank
    sums (accuracy, margin, num_tokens) or bounds (min_reward, max_reward)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(4, margin=True))
    common = ["--model", str(folders["reward"]), "--dataset", str(data), "--max-steps", "2",
              "--seed", "5", "--learning-rate", "1e-2", "--center-rewards-coefficient", "0.1"]
    one = launch(tmp_path, "one", *common, "--per-device-train-batch-size", "4")
    two = launch(tmp_path, "two", *common, "--per-device-train-batch-size", "2", "--devices", "2",
                 "--strategy", "ddp")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "accuracy", "margin", "min_reward", "max_reward",
                    "mean_reward", "num_tokens"):
            assert a[key] == pytest.approx(b[key], abs=2e-5, rel=1e-5), (a["step"], key)
    assert (tmp_path / "two" / "final").is_dir()


@pytest.mark.parametrize("rows, flags, message", [
    ([{"text": "just text"}], [], "--method reward needs preference rows"),
    ([{"prompt": "a", "chosen": "b", "rejected": 3}], [], "'rejected' is int"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}], [], "'margin' is 'big'"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--beta", "0.2"], "--beta is for DPO or GRPO"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--num-generations", "4"],
     "--num-generations is for DPO or GRPO"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--center-rewards-coefficient", "-1"],
     "must not be negative"),
])
def test_bad_input_is_one_line_and_exit_2(folders, tmp_path, capsys, rows, flags, message):
    data = write_jsonl(tmp_path / "data.jsonl", rows * 4)
    status = main(["train", "--method", "reward", "--model", str(folders["reward"]), "--dataset",
                   str(data), "--max-steps", "1", "--output-dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# -- the token cache and sharded loading (issue 32's review) ---------------------------------------

def test_pairs_are_cached_once_per_node_and_read_back_as_encoded(folders, tmp_path, monkeypatch):
    """The reward recipe's pairs go through DPO's cache (hf_dpo.load_pairs, token_store): the
    first load encodes and writes them, a second one reads them back without encoding a row,
    equal to the eager encoding (margins included); the validation split held out as before."""
    from types import SimpleNamespace

    from hputrain.recipes.hf import data as hf_data
    from hputrain.methods.reward import recipe as hf_reward

    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(12, margin=True))
    options = SimpleNamespace(dataset=str(data), validation_split_percentage=25, dataset_num_proc=1)
    tokenizer = tokenizer_of(folders["causal"])
    load = lambda: hf_reward.load_reward_pairs(options, tokenizer, 64, cache_dir=tmp_path / "cache",  # noqa: E731
                                               tokenizer_folder=folders["causal"])
    train, held, stats = load()
    eager, eager_stats = encode_reward_pairs(hf_data.records(str(data)), tokenizer, 64)
    assert list(train) + list(held) == eager and stats == eager_stats and len(held) == 3
    assert all("margin" in pair for pair in eager)
    assert len([p for p in (tmp_path / "cache").glob("reward-*") if p.is_dir()]) == 1

    def encode(*_):
        raise AssertionError("the second load encoded rows: the cache was not read")

    monkeypatch.setattr(hf_reward, "encode_reward_part", encode)
    again, held_again, stats_again = load()
    assert list(again) == list(train) and list(held_again) == list(held) and stats_again == stats


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_fsdp_on_two_processes_loads_shards_and_trains_as_one(folders, tmp_path, lora):
    """Under fsdp each rank reads only its shards of the causal LM's folder, and the score head
    the folder lacks is drawn as from_pretrained draws it (LoRA's adapters as PEFT draws them):
    2 processes x 2 pairs equal 1 process x 4 pairs (one loads the whole model), first step
    included."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(4, margin=True))
    common = ["--model", str(folders["causal"]), "--dataset", str(data), "--max-steps", "2",
              "--seed", "5", "--learning-rate", "1e-2",
              *(["--lora-r", "4", "--lora-dropout", "0"] if lora else [])]
    one = launch(tmp_path, "one", *common, "--per-device-train-batch-size", "4")
    two = launch(tmp_path, "two", *common, "--per-device-train-batch-size", "2", "--devices", "2",
                 "--strategy", "fsdp")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "accuracy", "margin", "min_reward", "max_reward",
                    "mean_reward", "num_tokens"):
            assert a[key] == pytest.approx(b[key], abs=2e-5, rel=1e-5), (a["step"], key)
    said = (tmp_path / "two.stdout").read_text()
    assert "new score head" in said and "loads the whole model" not in said, said[-2000:]
    if lora:
        assert (tmp_path / "two" / "final" / "adapter_model.safetensors").is_file()
    else:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "two" / "final")
        assert model.config.num_labels == 1
