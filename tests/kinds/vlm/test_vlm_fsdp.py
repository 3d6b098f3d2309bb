"""Vision-language models under strategy="fsdp": the vision tower's encoder layers and the decoder
layers are the units (and the checkpointed blocks), the embeddings, norms and projector stay in
the root; activation checkpointing gives the loss and gradients of a run without it; the model
loads shard by shard (built on the meta device, each rank reading its own rows, transformers'
renaming of older layouts followed) bit for bit as from_pretrained loads it; and 2 processes
train as one with the doubled batch, with a frozen tower + LoRA, with full fine-tuning, with
checkpointing, on packed image blocks, and across a sharded checkpoint's save and resume
(tests/vlm_fsdp_script.py).

Most batches are built by hand (one image an example, unpacked): transformers' own forward runs
unchanged; one run trains on data.vision's packed blocks."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ... import vlm_fsdp_script as script
from ...distributed.test_distributed import ROOT, hputrain_launch
from ...recipes.test_sharded_loading import assert_no_whole_parameter_read
from ...vlm_fixtures import image_data, vlm_folders  # noqa: F401

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
SCRIPT = str(ROOT / "tests" / "vlm_fsdp_script.py")

BLOCKS = {"llava": ("CLIPEncoderLayer", "LlamaDecoderLayer"),
          "gemma3": ("SiglipEncoderLayer", "Gemma3DecoderLayer"),
          "qwen2_5_vl": ("Qwen2_5_VLVisionBlock", "Qwen2_5_VLDecoderLayer")}
"""Each family's vision-tower layer and decoder layer (2 of each in the tiny models)."""
TOWER = {"llava": "vision_tower", "qwen2_5_vl": "visual"}


def from_pretrained(folder):
    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)


def losses(path, key: str = "loss") -> list[float]:
    records = [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if "loss" in r]


def assert_same_losses(expected, actual, tol: float = 1e-5) -> None:
    """The same losses and gradient norms at each step (Adam's steps hardly see a gradient's
    scale: the norm does)."""
    assert len(losses(actual)) == len(losses(expected)) == script.STEPS
    for key in ("loss", "grad_norm"):
        assert losses(actual, key) == pytest.approx(losses(expected, key), abs=tol, rel=tol), key


def assert_close_states(expected: dict, actual: dict, tol: float) -> None:
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=tol, atol=tol, msg=name)


# -- one process ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl"])
def test_blocks_are_the_vision_layers_and_the_decoder_layers(vlm_folders, family):
    """The tower's embeddings and pooling head, which the model also lists as never split, are
    no blocks: they stay in the root with the projector and the norms."""
    from hputrain.distributed.blocks import block_modules, no_split_modules

    model = from_pretrained(vlm_folders(family))
    vision, decoder = BLOCKS[family]
    assert [type(b).__name__ for b in block_modules(model)] == [vision] * 2 + [decoder] * 2
    if family != "qwen2_5_vl":  # what the model lists as never split holds its tower's embeddings
        assert {"CLIPVisionEmbeddings", "SiglipVisionEmbeddings"} & no_split_modules(model)
    wrapped = script.prepared(vlm_folders(family), "lora", sharded=False)  # seen through PEFT too
    assert [type(b).__name__ for b in block_modules(wrapped)] == [vision] * 2 + [decoder] * 2


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl"])
def test_loading_on_the_meta_device_equals_from_pretrained_bit_for_bit(vlm_folders, family):
    """One process: built on the meta device, filled from the folder by its weight source, every
    tensor equals from_pretrained's, and the random generator is where from_pretrained leaves it
    (the recipe draws LoRA's adapters next). LLaVA's and Gemma 3's folders hold the older layout
    (language_model.model.*, as save_pretrained writes them back), which transformers'
    conversion mapping renames on loading, and so does the weight source."""
    from safetensors import safe_open

    from hputrain.distributed.fsdp import materialise, weight_source

    folder = vlm_folders(family)
    torch.manual_seed(0)
    drawn = torch.random.get_rng_state()
    model = script.load(folder, sharded=True)
    assert all(p.is_meta for p in model.parameters())
    # as from_pretrained, nothing drawn: LoRA's adapters come next from the same generator
    # (CLIP's class_embedding is made with torch.randn)
    assert torch.equal(torch.random.get_rng_state(), drawn)
    materialise(model, torch.device("cpu"), 0, weight_source(model))
    expected, actual = from_pretrained(folder).state_dict(), model.state_dict()
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        old_layout = any(key.startswith("language_model.model.") for key in handle.keys())
    assert old_layout == (family != "qwen2_5_vl")


def test_an_adapter_folder_loads_on_the_meta_device_as_peft_loads_it(tmp_path, vlm_folders):
    """A LoRA run's adapters (--model FINAL under fsdp, training continuing on them): the base
    on the meta device filled from its folder, the adapters PEFT's values, every tensor equal to
    load_vision's eager load (from_pretrained + PEFT)."""
    from hputrain.distributed.fsdp import materialise, weight_source
    from hputrain.kinds.vlm.recipe import load_vision

    trained = script.prepared(vlm_folders("llava"), "lora", sharded=False)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_()  # zero-initialised B would not show its values were loaded
    trained.save_pretrained(tmp_path / "adapter")
    expected = load_vision(tmp_path / "adapter", trainable=True)[0].state_dict()
    model = load_vision(tmp_path / "adapter", trainable=True, sharded=True)[0]
    assert any(p.is_meta for p in model.parameters())
    materialise(model, torch.device("cpu"), 0, weight_source(model))
    actual = model.state_dict()
    assert expected.keys() == actual.keys() and any("lora_B" in name for name in actual)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(vlm_folders, family):
    """Every block checkpointed (the tower's layers and the decoder's, all trained): the loss
    and every gradient equal those of the model without checkpointing."""
    from hputrain.config.sections import ActivationCheckpointing
    from hputrain.distributed.activation_checkpointing import apply_activation_checkpointing, is_checkpointed

    batch = script.collate(script.examples(from_pretrained(vlm_folders(family)).config)[:2])
    results = []
    for checkpointing in (False, True):
        model = from_pretrained(vlm_folders(family)).train()
        if checkpointing:
            settings = ActivationCheckpointing(gradient_checkpointing=True, gradient_checkpointing_every=1,
                                               fsdp_block_classes=None)
            chosen = apply_activation_checkpointing(model, settings)
            vision, decoder = BLOCKS[family]
            assert [type(b).__name__ for b in chosen] == [vision] * 2 + [decoder] * 2
            assert all(is_checkpointed(b) for b in chosen)
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain_loss, plain), (loss, grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-6)
    assert grads.keys() == plain.keys()
    unused = {name for name, grad in plain.items() if grad is None}  # LLaVA's post_layernorm
    assert unused == {name for name, grad in grads.items() if grad is None}
    assert not any(".layers." in name or ".blocks." in name for name in unused)
    for name in plain.keys() - unused:
        torch.testing.assert_close(grads[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


# -- two processes ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_two_ranks_train_as_one_process_loaded_shard_by_shard(tmp_path, vlm_folders, image_data, family):
    """2 processes of batch 1 against one of batch 2, 3 steps: a frozen tower + LoRA on the
    language model, full fine-tuning (tower frozen), everything trained with activation
    checkpointing, and LoRA with checkpointing on packed image blocks (data.vision's blocks and
    collator, the static image merge and block-causal mask of the training forward); each loaded
    shard by shard, bit for bit as from_pretrained (+ PEFT's draws under the same seed), no rank
    reading more than its half of a tensor; then full fine-tuning resumed from its sharded
    checkpoint of step 2 ends where it did. The one-process runs have no checkpointing."""
    folder = vlm_folders(family)
    runs = {"lora": ["lora"], "full": ["full", "save2"], "tower": ["tower", "checkpointing"],
            "packed": ["lora", "checkpointing", f"blocks={image_data('messages')}"]}
    specs = [",".join([str(tmp_path / name), *flags]) for name, flags in runs.items()]
    specs.append(f"{tmp_path / 'resumed'},full,from={tmp_path / 'full' / 'checkpoint-2'}")
    proc, _ = hputrain_launch("--cpu", "--nproc-per-node", "2", SCRIPT, str(folder), *specs, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, flags in runs.items():
        single = tmp_path / f"single-{name}"  # one process, from_pretrained, no checkpointing
        script.run(folder, single, *[f for f in flags if f not in ("save2", "checkpointing")], batch=2)
        two = tmp_path / name
        assert_same_losses(single, two)
        assert_close_states(torch.load(single / "weights.pt"), torch.load(two / "weights.pt"), tol=1e-5)
        expected, loaded = torch.load(single / "initial.pt"), torch.load(two / "initial.pt")
        assert expected.keys() == loaded.keys()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())
        assert_no_whole_parameter_read(tmp_path, name, folder)
        units = json.loads((two / "layout.json").read_text())["units"]
        tower_units = [u for u in units if f".{TOWER[family]}." in f".{u}."]
        assert len(tower_units) == 2 and all(".layers." in u or ".blocks." in u for u in tower_units), units
        assert sum(".language_model.layers." in u for u in units) == 2 and "" in units, units
        assert not any("embeddings" in u or "merger" in u or "projector" in u for u in units), units
    for name in ("tower", "packed"):
        checkpointed = json.loads((tmp_path / name / "layout.json").read_text())["checkpointed"]
        layers = [n for n in checkpointed if re.search(r"\.(layers|blocks)\.\d+$", n)]
        assert len(layers) == 4 and len([c for c in layers if ".language_model." in c]) == 2, checkpointed
    resumed = tmp_path / "resumed"
    assert losses(resumed) == pytest.approx(losses(tmp_path / "full")[-1:], abs=1e-6)
    assert_close_states(torch.load(tmp_path / "full" / "weights.pt"), torch.load(resumed / "weights.pt"),
                        tol=1e-6)


@pytest.mark.slow
def test_gemma3_on_two_ranks_trains_packed_blocks_as_one_process(tmp_path, vlm_folders, image_data):
    """Gemma 3 (its tied embedding and head in the root unit, each image's tokens attending both
    ways): full fine-tuning with activation checkpointing on packed blocks, 2 ranks of batch 1 as
    one process of batch 2 without checkpointing, loaded shard by shard as from_pretrained."""
    folder, data = vlm_folders("gemma3"), image_data("messages")
    proc, _ = hputrain_launch("--cpu", "--nproc-per-node", "2", SCRIPT, str(folder),
                              f"{tmp_path / 'two'},full,checkpointing,blocks={data}", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    script.run(folder, tmp_path / "one", "full", f"blocks={data}", batch=2)
    assert_same_losses(tmp_path / "one", tmp_path / "two")
    assert_close_states(torch.load(tmp_path / "one" / "weights.pt"), torch.load(tmp_path / "two" / "weights.pt"),
                        tol=1e-5)
    initial, loaded = torch.load(tmp_path / "one" / "initial.pt"), torch.load(tmp_path / "two" / "initial.pt")
    assert initial.keys() == loaded.keys() and all(torch.equal(loaded[k], v) for k, v in initial.items())
    units = json.loads((tmp_path / "two" / "layout.json").read_text())["units"]
    assert sum(".vision_tower." in u for u in units) == 2 and sum(".language_model.layers." in u for u in units) == 2
    assert not any("embed" in u or "lm_head" in u for u in units), units  # tied: in the root


@pytest.mark.slow
def test_hputrain_train_on_two_fsdp_ranks_equals_one_process(tmp_path, vlm_folders, image_data):
    """The recipe end to end: `hputrain train` on a LLaVA folder and image rows, LoRA (adapters
    drawn after --seed from a model loaded shard by shard), packed blocks, activation
    checkpointing, 2 fsdp processes of batch 1 as one process of batch 2."""
    import subprocess
    import sys

    def train(name: str, *args: str) -> Path:
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu",
                               "--model", str(vlm_folders("llava")), "--dataset", str(image_data("messages")),
                               "--block-size", "128", "--max-steps", str(script.STEPS), "--seed", "3",
                               "--lora-r", "4", "--lora-dropout", "0", "--learning-rate", "1e-3",
                               "--logging-steps", "1", "--disable-tqdm", "--validation-split-percentage", "0",
                               "--precision", "fp32", "--save-steps", "-1", "--output-dir", str(out), *args],
                              capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
        return out

    one = train("one", "--per-device-train-batch-size", "2")
    two = train("two", "--per-device-train-batch-size", "1", "--devices", "2", "--strategy", "fsdp",
                "--gradient-checkpointing")
    assert_same_losses(one, two)
    assert (two / "final" / "adapter_config.json").is_file()
