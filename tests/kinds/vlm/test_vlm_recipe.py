"""Issue 41: `hputrain train` and `hputrain evaluate` with an image-text-to-text folder
(kinds/vlm/run.py), in-process through `hputrain.cli.main`, on the tiny LLaVA, Gemma 3
and Qwen2.5-VL folders and image data of tests/vlm_fixtures.py.

The reference numbers are transformers' own: each example alone through the model's forward
(input ids from the data path, asserted equal to the processor's where the folder has one; pixel
values from the folder's image processor; Gemma 3's token_type_ids as its processor makes them;
Qwen2.5-VL's positions from its own get_rope_index), its loss weighted by its learned tokens."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ...vlm_fixtures import image_data, vlm_folders  # noqa: F401
from ...vlm_fixtures import FAMILIES, image_rows, save_image_dataset, write_image_dataset

transformers = pytest.importorskip("transformers")

from hputrain.cli import main  # noqa: E402
from hputrain.errors import InputError  # noqa: E402
from hputrain.kinds.vlm.data.encode import encode_row  # noqa: E402
from hputrain.kinds.vlm.data.rows import open_image, split_rows  # noqa: E402
from hputrain.recipes.hf import data as hf_data  # noqa: E402
from hputrain.kinds.vlm.recipe import load_vision  # noqa: E402

SMALL = ["--block-size", "128", "--per-device-train-batch-size", "2", "--logging-steps", "1",
         "--disable-tqdm", "--precision", "32"]
TOWER = {"llava": "model.vision_tower.", "gemma3": "model.vision_tower.", "qwen2_5_vl": "model.visual."}
PROJECTOR = {"llava": "model.multi_modal_projector.", "gemma3": "model.multi_modal_projector.",
             "qwen2_5_vl": "model.visual.merger."}


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def train(out, model, dataset, *argv) -> int:
    return main(["train", "--model", str(model), "--dataset", str(dataset), "--output-dir", str(out),
                 *SMALL, *argv])


def evaluate(model, dataset, *argv) -> dict:
    from hputrain.cli import main as cli

    return cli(["evaluate", "--model", str(model), "--dataset", str(dataset), "--json", *argv])


def records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def model_inputs(processing, example, size: int) -> dict:
    """transformers' inputs for one encoded example cut to `size` tokens: its ids, the image
    processor's pixel values of its images (each in its bucket), Gemma 3's token types."""
    ids = torch.as_tensor(example.input_ids[:size], dtype=torch.long)[None]
    inputs = {"input_ids": ids}
    images = [processing.buckets.resize(open_image(ref), bucket)
              for ref, bucket in zip(example.images, example.buckets)]
    if images:
        inputs |= dict(processing.image_processor(images=images, return_tensors="pt"))
    if processing.family.bidirectional_images:
        inputs["token_type_ids"] = (ids == processing.image_token_id).long()
    return inputs


def reference_loss(folder: Path, data: Path, block_size: int, fmt: str = "messages",
                   model=None, split: str = "train") -> tuple[float, int, int]:
    """(the token-weighted mean of transformers' per-example loss, the learned tokens, the examples
    longer than the block) over every row of `data`, each example cut to `block_size` tokens."""
    loaded, processing = load_vision(folder)
    model = (model or loaded).eval()
    total, count, cut = 0.0, 0, 0
    for where, row, base in split_rows(str(data), split, hf_data.records, hf_data.source_files):
        example = encode_row(row, fmt, processing, where, base)
        labels = torch.as_tensor(example.labels[:block_size], dtype=torch.long)
        learned = int((labels[1:] != -100).sum())
        cut += len(example.input_ids) > block_size
        if processing.processor is not None and len(example.input_ids) <= block_size and "messages" in row:
            # the ids are the processor's own for the rendered conversation and its images
            text = processing.tokenizer.apply_chat_template(row["messages"], tokenize=False)
            made = processing.processor(text=text, images=[open_image(r) for r in example.images] or None,
                                        return_tensors="pt")
            assert made["input_ids"][0].tolist() == example.input_ids.tolist()
        if not learned:
            continue
        with torch.no_grad():
            loss = model(**model_inputs(processing, example, block_size), labels=labels[None]).loss
        total, count = total + float(loss) * learned, count + learned
    return total / count, count, cut


# -- evaluate ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_evaluate_equals_transformers_per_example_loss(vlm_folders, image_data, family, packing, capsys):  # noqa: F811
    folder, data = vlm_folders(family), image_data("messages")
    argv = ["--block-size", "96"] + ([] if packing else ["--no-packing"])
    assert evaluate(folder, data, *argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    loss, tokens, cut = reference_loss(folder, data, 96)
    assert result["eval_loss"] == pytest.approx(loss, abs=1e-5)
    assert result["eval_tokens"] == tokens and result["examples_cut"] == cut > 0
    assert f"{cut} cut to --block-size 96" in err and f"{cut} examples were longer" in err


@pytest.mark.parametrize("fmt, family", [("prompt_completion", "llava"), ("image", "qwen2_5_vl"),
                                         ("saved", "gemma3")])
def test_evaluate_on_the_other_row_formats_equals_transformers(vlm_folders, image_data, fmt, family,
                                                               tmp_path, capsys):  # noqa: F811
    """prompt-completion rows, a single image column, and a save_to_disk folder whose images are
    a datasets Image feature."""
    folder = vlm_folders(family)
    data = save_image_dataset(tmp_path / "saved") if fmt == "saved" else image_data(fmt)
    assert evaluate(folder, data, "--block-size", "96") == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loss, tokens, cut = reference_loss(folder, data, 96, "messages" if fmt == "saved" else fmt)
    assert result["eval_loss"] == pytest.approx(loss, abs=1e-5)
    assert (result["eval_tokens"], result["examples_cut"]) == (tokens, cut)


def test_chat_rows_without_images_train_the_language_model_through_the_same_path(
        vlm_folders, tmp_path, capsys):  # noqa: F811
    """Text chat rows with an image-text-to-text folder: image rows with no image (the decision:
    the language model learns them through the same blocks and forward)."""
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": "an answer " * (1 + i % 3)}]} for i in range(10)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = vlm_folders("qwen2_5_vl")
    assert evaluate(folder, data) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loss, tokens, _ = reference_loss(folder, data, 1024)
    assert result["eval_loss"] == pytest.approx(loss, abs=1e-5) and result["eval_tokens"] == tokens
    assert result["images"] == 0


def test_text_rows_on_a_type_causal_lm_also_takes_go_the_text_path_as_before(vlm_folders, tmp_path, capsys):  # noqa: F811
    """Gemma 3 (AutoModelForCausalLM takes it too) on text chat rows: the SFT path of text models,
    whose loss is transformers' causal LM's per example (test_sft_recipe's reference)."""
    from ...methods.sft.test_sft_recipe import reference_loss as text_reference

    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": "an answer " * (1 + i % 3)}]} for i in range(6)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = vlm_folders("gemma3")
    assert evaluate(folder, data) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loss, tokens = text_reference(folder, rows)
    assert result["method"] == "messages" and "images" not in result
    assert result["eval_loss"] == pytest.approx(loss, abs=1e-5) and result["eval_tokens"] == tokens


# -- train: full fine-tuning, final/ --------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_full_fine_tuning_writes_a_final_folder_transformers_loads(vlm_folders, image_data, family,
                                                                  tmp_path, capsys):  # noqa: F811
    folder, out = vlm_folders(family), tmp_path / "run"
    assert train(out, folder, image_data("messages"), "--max-steps", "2", "--learning-rate", "1e-3") == 0
    stdout = capsys.readouterr().out
    name = {"llava": "LLaVA", "gemma3": "Gemma 3", "qwen2_5_vl": "Qwen2.5-VL"}[family]
    assert f"(image-text-to-text: {name})" in stdout
    assert re.search(r"images: \d+ pixel buckets? \(.*\) of (\d+ to )?\d+ image tokens.*, \d+ slots? a block, "
                     r"\d+ images?, [\d.]+% of the slots padding", stdout)
    final = out / "final"
    assert f'AutoModelForImageTextToText.from_pretrained("{final}")' in stdout
    trained = transformers.AutoModelForImageTextToText.from_pretrained(final)
    start = transformers.AutoModelForImageTextToText.from_pretrained(folder)
    before = dict(start.named_parameters())
    changed = {n for n, p in trained.named_parameters() if not torch.equal(p, before[n])}
    assert changed and not any(n.startswith(TOWER[family]) and not n.startswith(PROJECTOR[family])
                               for n in changed)  # the tower is frozen by default
    assert any(n.startswith(PROJECTOR[family]) for n in changed)  # the projector trains
    assert any(n.startswith("model.language_model.") for n in changed)
    _same_processing(folder, final, family)


def test_a_chat_template_given_is_the_one_final_holds(vlm_folders, image_data, tmp_path):  # noqa: F811
    from ...vlm_fixtures import chat_template

    template = tmp_path / "tagged.jinja"
    template.write_text(chat_template("llava", tagged=True))
    out = tmp_path / "run"
    assert train(out, vlm_folders("llava"), image_data("messages"), "--max-steps", "1",
                 "--chat-template", str(template), "--save-steps", "-1") == 0
    assert transformers.AutoProcessor.from_pretrained(out / "final").chat_template == template.read_text()
    assert transformers.AutoProcessor.from_pretrained(vlm_folders("llava")).chat_template != template.read_text()


def _same_processing(folder: Path, final: Path, family: str) -> None:
    """final/'s processor (or tokenizer + image processor) encodes a conversation with an image
    as the model folder's does (the chat template and image processor kept)."""
    from PIL import Image

    image = Image.new("RGB", (40, 30), (10, 200, 30))
    messages = image_rows(1, ["x.png"])[0]["messages"]
    made = []
    for source in (folder, final):
        if family == "qwen2_5_vl":  # no processor class here (torchvision): its two parts
            tokenizer = transformers.AutoTokenizer.from_pretrained(source)
            pixels = transformers.AutoImageProcessor.from_pretrained(source)(images=[image], return_tensors="pt")
            made.append((tokenizer.apply_chat_template(messages, tokenize=False), pixels["pixel_values"]))
        else:
            processor = transformers.AutoProcessor.from_pretrained(source)
            text = processor.apply_chat_template(messages, tokenize=False)
            encoded = processor(text=text, images=[image], return_tensors="pt")
            made.append((encoded["input_ids"].tolist(), encoded["pixel_values"]))
    assert made[0][0] == made[1][0] and torch.equal(made[0][1], made[1][1])


# -- train: LoRA, PEFT, export --merge -------------------------------------------------------------

def _image_example(folder: Path, scratch: Path):
    """One image example's transformers inputs (the data path's encoding of the first row)."""
    _, processing = load_vision(folder)
    data = write_image_dataset(scratch / "one", rows=2)
    where, row, base = next(split_rows(str(data), "train", hf_data.records, hf_data.source_files))
    return model_inputs(processing, encode_row(row, "messages", processing, where, base), 10_000)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_final_loads_in_peft_and_export_merge_gives_its_logits(vlm_folders, image_data, family,
                                                                   tmp_path, capsys):  # noqa: F811
    peft = pytest.importorskip("peft")
    folder, out = vlm_folders(family), tmp_path / "run"
    assert train(out, folder, image_data("messages"), "--max-steps", "2", "--lora-r", "4",
                 "--learning-rate", "1e-2", "--train-projector") == 0
    assert "export --merge" in capsys.readouterr().out
    final = out / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert re.fullmatch(config["target_modules"], "model.language_model.layers.0.self_attn.q_proj")
    assert not re.fullmatch(config["target_modules"], TOWER[family] + "blocks.0.attn.qkv")
    base = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    inputs = _image_example(folder, tmp_path)
    with torch.no_grad():
        plain = base(**inputs).logits
        tuned = peft.PeftModel.from_pretrained(base, final).eval()(**inputs).logits
    assert (tuned - plain).abs().max() > 1e-3  # the adapters (and the projector) moved
    capsys.readouterr()
    assert evaluate(final, image_data("messages"), "--block-size", "96") == 0  # final/ as --model
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    loss, _, _ = reference_loss(folder, image_data("messages"), 96,
                                model=peft.PeftModel.from_pretrained(
                                    transformers.AutoModelForImageTextToText.from_pretrained(folder), final))
    assert result["eval_loss"] == pytest.approx(loss, abs=1e-5)
    assert main(["export", "--merge", str(final), "--output", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.allclose(merged(**inputs).logits, tuned, atol=1e-5, rtol=0)
    _same_processing(folder, tmp_path / "merged", family)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_tower_and_projector_flags_reach_the_trained_folder(vlm_folders, image_data, tmp_path, lora,
                                                               capsys):  # noqa: F811
    """Qwen2.5-VL, whose projector sits inside its tower: --train-vision-tower --no-train-projector
    trains the tower and not the merger; under LoRA, the tower's layers get adapters too."""
    folder, out = vlm_folders("qwen2_5_vl"), tmp_path / "run"
    flags = ["--lora-r", "4"] if lora else ["--no-train-projector"]
    assert train(out, folder, image_data("image"), "--max-steps", "2", "--learning-rate", "1e-2",
                 "--train-vision-tower", *flags) == 0
    header = capsys.readouterr().out
    assert ("vision tower trained, projector frozen (--train-projector trains it)" if lora else
            "vision tower trained, projector frozen (--no-train-projector)") in header
    if lora:
        from safetensors.torch import load_file

        names = list(load_file(out / "final" / "adapter_model.safetensors"))
        assert any(".visual.blocks." in n for n in names) and any(".language_model." in n for n in names)
        assert not any(".merger." in n for n in names)
        return
    trained = dict(transformers.AutoModelForImageTextToText.from_pretrained(out / "final").named_parameters())
    start = transformers.AutoModelForImageTextToText.from_pretrained(folder)
    changed = {n for n, p in start.named_parameters() if not torch.equal(p, trained[n])}
    assert any(n.startswith("model.visual.blocks.") for n in changed)
    assert not any(n.startswith(PROJECTOR["qwen2_5_vl"]) for n in changed)


# -- resume, validation, bf16, refusals ------------------------------------------------------------

@pytest.mark.slow
def test_resume_after_a_stop_continues_as_one_run(vlm_folders, image_data, tmp_path):  # noqa: F811
    folder, data = vlm_folders("llava"), image_data("messages")
    flags = ["--learning-rate", "1e-3", "--lr-scheduler-type", "constant", "--warmup-steps", "0",
             "--save-steps", "4", "--lora-r", "4", "--train-projector"]
    assert train(tmp_path / "straight", folder, data, "--max-steps", "8", *flags) == 0
    assert train(tmp_path / "resumed", folder, data, "--max-steps", "4", *flags) == 0
    assert train(tmp_path / "resumed", folder, data, "--max-steps", "8", *flags,
                 "--resume-from-checkpoint", "latest") == 0
    from safetensors.torch import load_file

    one, two = (load_file(tmp_path / run / "final" / "adapter_model.safetensors")
                for run in ("straight", "resumed"))
    assert one.keys() == two.keys() and all(torch.allclose(one[k], two[k], atol=1e-6) for k in one)
    losses = [[r["loss"] for r in records(tmp_path / run) if "loss" in r and r["step"] > 4]
              for run in ("straight", "resumed")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5) and len(losses[0]) == 4


@pytest.mark.slow
def test_two_processes_with_a_trained_tower_train_as_one(vlm_folders, image_data, tmp_path):  # noqa: F811
    """Gemma 3 with --train-vision-tower (its pooling head never gets a gradient) on 2 processes,
    one block each, ends where one process with both blocks in a batch ends."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    for devices in (1, 2):
        proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu",
                               "--model", str(vlm_folders("gemma3")), "--dataset", str(image_data("messages")),
                               "--output-dir", str(tmp_path / str(devices)), *SMALL, "--max-steps", "2",
                               "--devices", str(devices), "--per-device-train-batch-size", str(2 // devices),
                               "--train-vision-tower", "--learning-rate", "1e-3", "--save-steps", "-1"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (load_file(tmp_path / str(d) / "final" / "model.safetensors") for d in (1, 2))
    assert all(torch.allclose(one[k], two[k], atol=1e-5) for k in one)
    start = load_file(vlm_folders("gemma3") / "model.safetensors")
    assert any(not torch.equal(one[k], start[k]) for k in one if "vision_tower" in k and ".encoder." in k)


def test_gradient_accumulation_equals_the_larger_batch(vlm_folders, image_data, tmp_path):  # noqa: F811
    """Qwen2.5-VL under LoRA: 2 micro-batches of 1 block accumulated give the step of 1 batch of 2
    blocks (whose image slots the collator orders real images first across both)."""
    from safetensors.torch import load_file

    for accumulate in (1, 2):
        assert train(tmp_path / str(accumulate), vlm_folders("qwen2_5_vl"), image_data("messages"),
                     "--max-steps", "1", "--gradient-accumulation-steps", str(accumulate),
                     "--per-device-train-batch-size", str(2 // accumulate), "--learning-rate", "1e-3",
                     "--lora-r", "4", "--lora-dropout", "0", "--save-steps", "-1") == 0
    one, two = (load_file(tmp_path / str(a) / "final" / "adapter_model.safetensors") for a in (1, 2))
    assert all(torch.allclose(one[k], two[k], atol=1e-6) for k in one)
    assert any(one[k].abs().max() > 1e-4 for k in one if "lora_B" in k)  # the step moved them


def test_activation_checkpointing_under_lora_trains_as_without(vlm_folders, image_data, tmp_path,
                                                               monkeypatch):  # noqa: F811
    """Gemma 3 under LoRA (the embeddings and tower frozen: no input of a checkpointed block
    requires grad) with --gradient-checkpointing ends where the same run without it ends."""
    import torch.utils.checkpoint as torch_checkpoint
    from safetensors.torch import load_file

    calls = []
    original = torch_checkpoint.checkpoint
    monkeypatch.setattr(torch_checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
    for name, flags in (("plain", []), ("checkpointed", ["--gradient-checkpointing"])):
        assert train(tmp_path / name, vlm_folders("gemma3"), image_data("messages"), "--max-steps", "1",
                     "--learning-rate", "1e-3", "--lora-r", "4", "--lora-dropout", "0",
                     "--save-steps", "-1", *flags) == 0
        assert bool(calls) == bool(flags)  # the blocks were recomputed only when asked
    one, two = (load_file(tmp_path / n / "final" / "adapter_model.safetensors") for n in ("plain", "checkpointed"))
    assert all(torch.allclose(one[k], two[k], atol=1e-6) for k in one)
    assert any(one[k].abs().max() > 1e-4 for k in one if "lora_B" in k)


def test_validation_at_eval_steps_is_the_held_out_examples_loss(vlm_folders, tmp_path):  # noqa: F811
    folder = vlm_folders("gemma3")
    data = write_image_dataset(tmp_path / "data", rows=20)
    held = data.parent / "held.jsonl"  # the last 5% of 20 rows: the last one
    held.write_text(data.read_text().splitlines()[-1] + "\n")
    out = tmp_path / "run"
    assert train(out, folder, data, "--max-steps", "4", "--eval-steps", "2", "--learning-rate", "1e-3") == 0
    evals = [r for r in records(out) if "eval_loss" in r]
    assert [r["step"] for r in evals][:2] == [2, 4] and evals[0]["eval_loss"] != evals[1]["eval_loss"]
    loss, _, _ = reference_loss(out / "final", held, 128)
    assert evals[-1]["eval_loss"] == pytest.approx(loss, abs=1e-5)


def test_a_dataset_dicts_own_validation_split_is_evaluated(vlm_folders, tmp_path, capsys):  # noqa: F811
    datasets = pytest.importorskip("datasets")
    rows = datasets.load_from_disk(str(save_image_dataset(tmp_path / "rows")))
    data = tmp_path / "splits"
    datasets.DatasetDict({"train": rows.select(range(20)), "validation": rows.select(range(20, 24))}
                         ).save_to_disk(str(data))
    out = tmp_path / "run"
    capsys.readouterr()
    assert train(out, vlm_folders("llava"), data, "--max-steps", "1", "--save-steps", "-1") == 0
    assert "validation: the data set's own validation split" in capsys.readouterr().out
    loss, _, _ = reference_loss(out / "final", data, 128, split="validation")
    assert [r for r in records(out) if "eval_loss" in r][-1]["eval_loss"] == pytest.approx(loss, abs=1e-5)


def test_bf16_trains_near_the_fp32_losses(vlm_folders, image_data, tmp_path):  # noqa: F811
    folder, data = vlm_folders("llava"), image_data("messages")
    runs = {}
    for precision in ("32", "bf16"):
        out = tmp_path / precision
        assert train(out, folder, data, "--max-steps", "3", "--learning-rate", "1e-3",
                     "--precision", precision) == 0
        runs[precision] = [r["loss"] for r in records(out) if "loss" in r]
    assert runs["bf16"] != runs["32"]  # bf16 did run in bf16
    assert runs["bf16"] == pytest.approx(runs["32"], rel=2e-2)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("case, words", [
    ("dpo", "DPO (--method dpo) on an image-text-to-text model"),
    ("reward", "a reward model (--method reward) on an image-text-to-text model"),
    ("grpo", "GRPO (--method grpo) on an image-text-to-text model"),
    ("text", "is not image data, and --model"),
    ("streaming", "--streaming reads text shards"),
    ("lm", "--method lm trains on plain text"),
])
def test_what_the_image_path_does_not_take_is_one_line(vlm_folders, image_data, tmp_path, capsys,
                                                       case, words):  # noqa: F811
    data, argv = image_data("messages"), []
    if case == "dpo":
        data = _write(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 4)
    elif case == "reward":
        argv = ["--method", "reward"]
    elif case == "grpo":
        data = _write(tmp_path / "prompts.jsonl", [{"prompt": "a"}] * 4)
        argv = ["--method", "grpo", "--reward-funcs", str(tmp_path / "r.py") + ":f"]
        (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    elif case == "text":
        data = tmp_path / "plain.txt"
        data.write_text("plain text " * 100)
    elif case == "streaming":
        argv = ["--streaming", "--max-steps", "2"]
    elif case == "lm":
        argv = ["--method", "lm"]
    folder = vlm_folders("llava")
    capsys.readouterr()  # the fixtures' progress bars
    assert train(tmp_path / "run", folder, data, "--max-steps", "1", *argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "run" / "final").exists()


def test_an_uncovered_image_text_to_text_type_is_one_line(tmp_path, image_data, capsys):  # noqa: F811
    folder = tmp_path / "other"
    transformers.PaliGemmaConfig().save_pretrained(folder)  # covered nowhere: refused before loading
    data = image_data("messages")
    capsys.readouterr()
    assert train(tmp_path / "run", folder, data, "--max-steps", "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "paligemma" in err[0] and "--model" in err[0]


# -- issue 47 items 16, 17: images that cannot be read, Parquet images read in place --------------

def _with_a_cut_image(folder: Path, rows: int = 16) -> tuple[Path, int, Path]:
    """An image data set of `rows` rows whose row 12 (line 12) holds the only reference to an
    image file cut in the middle of its body (its header whole: the size reads); (the data file,
    that line, the image)."""
    data = write_image_dataset(folder, rows=rows)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    cut = folder / "images" / "cut.png"
    whole = (folder / records[11]["images"][0]).read_bytes()
    cut.write_bytes(whole[:len(whole) // 2])
    records[11]["images"][0] = "images/cut.png"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data, 12, cut


def test_a_cut_image_is_one_line_naming_its_row_before_the_first_step(vlm_folders, tmp_path, capsys):  # noqa: F811
    """Item 16: an image whose body is cut short (its header whole) is met while the data set is
    encoded, every image decoded, in one line naming the row and the flag that skips it, exit 2,
    before the first step. It was met when its block was made, mid-run (exit 2 at step 14 of 40,
    without a checkpoint)."""
    data, line, cut = _with_a_cut_image(tmp_path / "data")
    capsys.readouterr()
    status = train(tmp_path / "run", vlm_folders("llava"), data, "--max-steps", "8", "--save-steps", "2",
                   "--per-device-train-batch-size", "1")
    err = capsys.readouterr().err.strip().splitlines()
    run = tmp_path / "run"
    assert status == 2 and "Traceback" not in "\n".join(err), err
    assert not list(run.glob("checkpoint-*")) and not (run / "metrics.jsonl").exists(), "steps were trained"
    said = [text for text in err if text.startswith("hputrain: error:")]
    assert len(said) == 1 and said[0].startswith(
        f"hputrain: error: --dataset {data} line {line}: image {cut} cannot be read: "), said
    assert said[0].endswith("; fix or remove the row, or pass --skip-bad-rows to leave out the rows "
                            "whose image cannot be read"), said


def test_skip_bad_rows_leaves_them_out_and_the_header_counts_them(vlm_folders, tmp_path, capsys):  # noqa: F811
    """Item 16: --skip-bad-rows trains on the other rows; the header says how many were left out
    and the first one's line. The examples cached by that run, read by a run without the flag
    (another output_dir, the same --cache-dir), end it in that line rather than skip silently."""
    data, line, cut = _with_a_cut_image(tmp_path / "data")
    folder, cache = vlm_folders("llava"), tmp_path / "cache"
    capsys.readouterr()
    assert train(tmp_path / "skip", folder, data, "--max-steps", "2", "--skip-bad-rows",
                 "--cache-dir", str(cache)) == 0
    out = capsys.readouterr().out
    assert (f"hputrain: 16 rows, 0 skipped with nothing to learn, 1 skipped with an image that cannot be "
            f"read (--skip-bad-rows; the first: --dataset {data} line {line}: image {cut} cannot be "
            "read: ") in out, out
    assert train(tmp_path / "strict", folder, data, "--max-steps", "2", "--cache-dir", str(cache)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--dataset {data} line {line}: image {cut}" in err[0], err


def _parquet_rows(folder: Path, rows: int = 12, compression: str | None = None) -> tuple[Path, list]:
    """The `messages` rows of vlm_fixtures as datasets writes them to Parquet (an `images` column
    of datasets.Image: PNG bytes, uncompressed and PLAIN), or rewritten by pyarrow with
    `compression` (its default, snappy, where it is given); (the file, each row's image bytes)."""
    import pyarrow.parquet as pq

    saved = save_image_dataset(folder / "saved", rows=rows)
    path = folder / "data.parquet"
    datasets = pytest.importorskip("datasets")
    datasets.load_from_disk(str(saved)).to_parquet(str(path))
    if compression:
        pq.write_table(pq.read_table(path), path, compression=compression)
    table = pq.read_table(path, columns=["images"]).column("images").to_pylist()
    return path, [[image["bytes"] for image in row] for row in table]


def test_parquet_images_are_references_into_the_file(vlm_folders, tmp_path):  # noqa: F811
    """Item 17: the images of a Parquet file written by datasets (an Image column) are kept as
    their place in the file (FileSpan), which reads back their exact bytes, and the cache holds
    no image; a file rewritten with snappy compression keeps its images as bytes, and both train
    on the same pixel values. A file changed after its rows were read is one line."""
    from hputrain.kinds.vlm.data import cache as image_cache
    from hputrain.kinds.vlm.data.parquet import FileSpan
    from hputrain.recipes import HFOptions
    from hputrain.kinds.vlm.run import load_image_rows

    folder = vlm_folders("llava")
    _, processing = load_vision(folder)
    found = {}
    for kind, compression in (("plain", None), ("snappy", "snappy")):
        path, images = _parquet_rows(tmp_path / kind, compression=compression)
        options = HFOptions(model=str(folder), dataset=str(path), validation_split_percentage=0,
                            dataset_num_proc=1)
        data = load_image_rows(options, processing, 128, tmp_path / kind / "cache")
        examples, _ = image_cache._read(data.cache_file)
        refs = [ref for i in range(len(examples)) for ref in examples[i].images]
        assert [ref for row in images for ref in row] == [
            ref.read() if isinstance(ref, FileSpan) else ref for ref in refs]
        found[kind] = (refs, examples, data.cache_file)
    spans, examples, cached = found["plain"]
    assert spans and all(isinstance(ref, FileSpan) for ref in spans)
    image_bytes = sum(span.length for span in spans)
    assert (cached / "refs.npy").stat().st_size < image_bytes / 4  # references, not images
    assert all(isinstance(ref, bytes) for ref in found["snappy"][0])
    for i in range(len(examples)):
        for ref, other, bucket in zip(examples[i].images, found["snappy"][1][i].images, examples[i].buckets):
            assert torch.equal(processing.pixels(ref, bucket)["pixel_values"],
                               processing.pixels(other, bucket)["pixel_values"])
    moved = FileSpan(**{**spans[0].__dict__, "mtime_ns": spans[0].mtime_ns - 1})
    with pytest.raises(InputError, match="changed after its rows were read"):
        moved.read()


PEAK_RSS = '''
import dataclasses, json, sys, tempfile
from pathlib import Path
from hputrain.recipes import HFOptions
from hputrain.kinds.vlm.recipe import load_vision
from hputrain.kinds.vlm.run import load_image_rows

folder, data, warm = map(Path, sys.argv[1:4])
_, processing = load_vision(folder)
options = HFOptions(model=str(folder), dataset=str(warm), dataset_num_proc=1, validation_split_percentage=0)
with tempfile.TemporaryDirectory() as cache:  # what is loaded and allocated once
    load_image_rows(options, processing, 128, cache)

def peak():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 1024

Path("/proc/self/clear_refs").write_text("5")
base = peak()
with tempfile.TemporaryDirectory() as cache:
    loaded = load_image_rows(dataclasses.replace(options, dataset=str(data)), processing, 128, cache)
    for i in range(len(loaded.train)):
        loaded.train[i]
print(json.dumps({"grown_mib": peak() - base, "images": loaded.stats.images}))
'''


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak RSS reset")
def test_peak_rss_of_a_parquet_of_images_does_not_grow_with_its_images(vlm_folders, tmp_path):  # noqa: F811
    """Item 17: encoding a Parquet file of ~96 MiB of JPEG images (a datasets Image column) and
    reading every block once grows the process's peak resident set by less than half the images'
    size plus 32 MiB (measured: +45 MiB; +5.5 MiB per MiB of images, about 540 MiB, before the
    images were read in place: each held as bytes, then copied again into the cache)."""
    import subprocess
    import sys

    from ...vlm_fixtures import write_jpeg_parquet as write_parquet

    data, warm = tmp_path / "images.parquet", tmp_path / "warm-up.parquet"
    _, image_bytes = write_parquet(data, 96)
    write_parquet(warm, 0.5, seed=1)
    run = subprocess.run([sys.executable, "-c", PEAK_RSS, str(vlm_folders("llava")), str(data), str(warm)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    images = image_bytes / (1 << 20)
    assert result["images"] > 100 and result["grown_mib"] < images / 2 + 32, (result, images)
