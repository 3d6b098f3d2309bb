"""Issue 41: what trains in an image-text-to-text model (kinds/vlm/recipe.py): the vision tower
frozen unless --train-vision-tower, the projector trained in full fine-tuning and under LoRA only
with --train-projector (whole, PEFT's modules_to_save), LoRA on the language model's linear layers
(+ the tower's). Checked for each family on the tiny folders: the parameters that require grad,
and a step of the optimizer on a batch with an image (transformers' processor output, or for
Qwen2.5-VL its image processor's with the image tokens expanded as its processor does) changes
exactly the parameters that require grad and got a gradient."""
from __future__ import annotations

from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from ...vlm_fixtures import FAMILIES, vlm_folders  # noqa: F401

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from hputrain.errors import InputError  # noqa: E402
from hputrain.kinds.vlm.recipe import TokenizerAndImages, load_vision, part_prefixes, prepare_parts, saver

TOWER = {"llava": "model.vision_tower", "gemma3": "model.vision_tower", "qwen2_5_vl": "model.visual"}
PROJECTOR = {"llava": "model.multi_modal_projector", "gemma3": "model.multi_modal_projector",
             "qwen2_5_vl": "model.visual.merger"}


def options(lora_r=None, tower=False, projector=None, targets=None):
    return SimpleNamespace(lora_r=lora_r, lora_alpha=None, lora_dropout=0.0, lora_target_modules=targets,
                           train_vision_tower=tower, train_projector=projector)


def image_batch(folder: Path, processor, family: str) -> dict:
    """One conversation with an image, as transformers' processor encodes it (`processor`: the
    Processing load_vision gives), labels = ids."""
    from PIL import Image

    image = Image.new("RGB", (28, 28), (200, 30, 60))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "a red square"}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    if processor.processor is None:  # Qwen2.5-VL: <|image_pad|> × grid / merge², as its processor
        pixels = processor.image_processor(images=[image], return_tensors="pt")
        count = int(pixels["image_grid_thw"].prod()) // processor.image_processor.merge_size ** 2
        text = text.replace("<|image_pad|>", "<|image_pad|>" * count)
        batch = dict(processor.tokenizer(text, return_tensors="pt")) | dict(pixels)
    else:
        batch = dict(processor.processor(text=text, images=[image], return_tensors="pt"))
    batch["labels"] = batch["input_ids"].clone()
    return batch


def expected(name: str, family: str, lora: bool, tower: bool, projector: bool | None) -> bool:
    """Whether the parameter `name` (of the bare model, or of PEFT's wrapper) should train."""
    bare = name.removeprefix("base_model.model.")
    if lora:
        if "lora_" in bare:
            return True
        return bool(projector) and "modules_to_save" in bare
    if bare.startswith(PROJECTOR[family] + "."):
        return projector is not False
    if bare.startswith(TOWER[family] + "."):
        return tower
    return True


CASES = [(False, False, None), (False, True, None), (False, False, False), (False, True, False),
         (True, False, None), (True, True, None), (True, False, True), (True, True, True)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lora, tower, projector", CASES)
def test_the_parts_that_train_are_those_asked_and_a_step_changes_exactly_them(
        vlm_folders, family, lora, tower, projector):  # noqa: F811
    folder = vlm_folders(family)
    torch.manual_seed(0)
    model, processor = load_vision(folder)
    if family == "gemma3":  # its projector's weight is drawn as zeros: nothing would reach the tower
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.02)
    model = prepare_parts(model, options(4 if lora else None, tower, projector))
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    want = {n for n, _ in model.named_parameters() if expected(n, family, lora, tower, projector)}
    assert trains == want
    if lora:  # the adapters sit on the language model's layers, and the tower's only when asked
        adapted = {n.split(".lora_")[0] for n in trains if ".lora_A." in n}
        inner = [n.removeprefix("base_model.model.") for n in adapted]
        assert inner and all(n.startswith(("model.language_model.", TOWER[family] + ".")) for n in inner)
        assert any(n.startswith(TOWER[family] + ".") for n in inner) == tower
        assert not any(n.startswith(PROJECTOR[family] + ".") for n in inner)
        for module in model.modules():  # B starts at zero: move it so that A gets a gradient too
            if hasattr(module, "lora_B"):
                for linear in module.lora_B.values():
                    torch.nn.init.normal_(linear.weight, std=0.02)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    model(**image_batch(folder, processor, family)).loss.backward()
    moved = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == moved and moved <= trains
    towers = {n for n in changed if n.removeprefix("base_model.model.").startswith(TOWER[family] + ".")
              and not n.removeprefix("base_model.model.").startswith(PROJECTOR[family] + ".")}
    assert bool(towers) == tower  # the tower learns when asked (its gradient reaches it)
    projected = any(PROJECTOR[family] in n for n in changed)
    assert projected == (bool(projector) if lora else projector is not False)


def test_lora_target_modules_are_taken_inside_the_language_model(vlm_folders):  # noqa: F811
    model, _ = load_vision(vlm_folders("llava"))
    wrapped = prepare_parts(model, options(4, targets=["q_proj", "v_proj"]))
    adapted = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in wrapped.named_parameters()
                      if ".lora_A." in n})
    layers = {n.split(".lora_")[0] for n, _ in wrapped.named_parameters() if ".lora_A." in n}
    assert adapted == ["q_proj", "v_proj"] and len(layers) == 4  # 2 layers × 2, none in CLIP's tower
    model, _ = load_vision(vlm_folders("llava"))
    with pytest.raises(InputError, match="no linear layer of that name under model.language_model"):
        prepare_parts(model, options(4, targets=["fc1"]))  # CLIP's MLP: not the language model's


@pytest.mark.parametrize("family", FAMILIES)
def test_the_parts_are_named_as_the_family_table_says(vlm_folders, family):  # noqa: F811
    model, processor = load_vision(vlm_folders(family))
    parts = part_prefixes(model)
    names = dict(model.named_modules())
    assert parts["tower"] == TOWER[family] and parts["projector"] == PROJECTOR[family]
    assert all(prefix in names for prefix in parts.values())
    assert (processor.processor is None) == (family == "qwen2_5_vl")
    assert isinstance(saver(processor), TokenizerAndImages) == (family == "qwen2_5_vl")
