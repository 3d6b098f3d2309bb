"""Packed image blocks through the training forward (issue 41, "the forward"): for LLaVA, Gemma 3
and Qwen2.5-VL, a batch of blocks in the data path's format (several examples a block, image slots
padded with blank images, the batch's real images first) gives, through PackedInputs and the
static image merge (training/packed.py, kinds/vlm/execution.py), the loss sum and the gradients of
transformers' own forward on each example alone (its processor's output, or for Qwen its image
processor's), within float32 rounding. Also: Gemma 3's image tokens must see each other both
ways (the loss differs without it), its sliding layers keep their window in a block longer than
it, and one example per row (unpacked) gives the same."""
import copy
import sys

import numpy as np
import pytest
import torch

from hputrain.data.batching import model_input_names
from hputrain.errors import InputError
from hputrain.kinds.vlm.data.blocks import ImageCollator
from hputrain.execution.precision import Precision
from hputrain.kinds.vlm.execution import image_model, static_batches, static_image_merge
from hputrain.kinds.vlm.family import image_token_id
from hputrain.training.packed import PackedInputs

from ...vlm_fixtures import FAMILIES, PLACEHOLDER, tiny_vlm_folder, vlm_folders  # noqa: F401

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

K = 2  # image slots per block
SIZES = {"llava": [(28, 28)], "gemma3": [(28, 28)],
         # (height, width): the square and the wide bucket, 64 patches each, whole 56-pixel
         # windows; a bucket of fewer tokens (36 patches in a slot of 64), partial windows
         "qwen2_5_vl": [(112, 112), (56, 224), (84, 84)]}
TEXTS = [("what is in the picture", "a red square on a dark field"), ("describe it", "two stripes"),
         ("which colour", "mostly blue and a little grey"), ("and then", "nothing more at all")]


def images(family: str, count: int, seed: int) -> list:
    """`count` random RGB images of the family's bucket sizes (taken in turn)."""
    rng = np.random.default_rng(seed)
    sizes = SIZES[family]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[(seed + i) % len(sizes)], 3), dtype=np.uint8))
            for i in range(count)]


class Family:
    """A tiny folder's model and what encodes its examples as transformers does."""

    def __init__(self, family: str, folder) -> None:
        self.family = family
        torch.manual_seed(0)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(folder).train()
        self.config = self.model.config
        self.image_token = image_token_id(self.config)
        if family == "qwen2_5_vl":  # no processor class here (torchvision): its two halves
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(folder)
            self.processor = None
        else:
            self.processor = transformers.AutoProcessor.from_pretrained(folder)

    def encode(self, prompt: str, answer: str, pictures: list) -> dict:
        """One example as transformers' model takes it, with labels: the text rendered in the
        chat form, image tokens expanded by the processor; labels the ids, -100 on image tokens."""
        text = (f"<|im_start|>user\n{PLACEHOLDER[self.family] * len(pictures)}{prompt}<|im_end|>\n"
                f"<|im_start|>assistant\n{answer}<|im_end|>\n")
        if self.processor is not None:
            inputs = dict(self.processor(text=[text], images=pictures or None, return_tensors="pt"))
        else:
            inputs = {}
            if pictures:
                inputs = dict(self.image_processor(images=pictures, return_tensors="pt"))
                merge = self.image_processor.merge_size ** 2
                for grid in inputs["image_grid_thw"]:
                    text = text.replace("<|image_pad|>", "<|placeholder|>" * int(grid.prod() // merge), 1)
                text = text.replace("<|placeholder|>", "<|image_pad|>")
            inputs["input_ids"] = self.tokenizer([text], return_tensors="pt")["input_ids"]
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token).int()
        labels = inputs["input_ids"].clone()
        labels[labels == self.image_token] = -100
        inputs["labels"] = labels
        return inputs

    def reference(self, model, example: dict) -> torch.Tensor:
        """transformers' own loss on one example, as a sum over its learned tokens."""
        loss = model(**example).loss
        return loss * (example["labels"][:, 1:] != -100).sum()

    def positions(self, model, example: dict) -> torch.Tensor:
        """The example's position ids as the block carries them: [length], or Qwen's [3, length]
        from transformers' get_rope_index."""
        ids = example["input_ids"]
        if self.family != "qwen2_5_vl":
            return torch.arange(ids.shape[1])
        if "image_grid_thw" not in example:
            return torch.arange(ids.shape[1]).expand(3, -1)
        position_ids, _ = model.model.get_rope_index(ids, example["mm_token_type_ids"],
                                                     image_grid_thw=example["image_grid_thw"])
        return position_ids[:, 0]

    def blank(self) -> dict:
        """A padding slot: a blank image of the first bucket, processed."""
        picture = Image.new("RGB", SIZES[self.family][0][::-1])
        if self.processor is not None:
            processed = self.processor.image_processor(images=[picture], return_tensors="pt")
            return {"pixel_values": processed["pixel_values"]}
        return dict(self.image_processor(images=[picture], return_tensors="pt"))


def block(family: Family, model, examples: list[dict], size: int) -> dict:
    """The examples packed into one block of `size` tokens and K image slots (the format of
    ISSUE41's design), built by hand from the examples' processor outputs."""
    pad = family.config.get_text_config().pad_token_id or 0
    out = {"input_ids": torch.full((size,), pad), "labels": torch.full((size,), -100),
           "position_ids": torch.zeros((3, size) if family.family == "qwen2_5_vl" else (size,), dtype=torch.long),
           "seq_lens": torch.zeros(size, dtype=torch.long)}
    at, slots = 0, []
    for k, example in enumerate(examples):
        n = example["input_ids"].shape[1]
        out["input_ids"][at:at + n] = example["input_ids"][0]
        out["labels"][at:at + n] = example["labels"][0]
        out["labels"][at] = -100
        out["position_ids"][..., at:at + n] = family.positions(model, example)
        out["seq_lens"][k] = n
        at += n
        if "pixel_values" in example:  # each image's patches (Qwen: its grid's count), or its image
            grids = example.get("image_grid_thw")
            sizes = grids.prod(-1).tolist() if grids is not None else [1] * len(example["pixel_values"])
            starts = np.cumsum([0] + sizes).tolist()
            slots += [{key: example[key][starts[i]:starts[i + 1]] if key == "pixel_values" else example[key][i:i + 1]
                       for key in ("pixel_values", "image_grid_thw") if key in example}
                      for i in range(len(sizes))]
    out["position_ids"][..., at:] = torch.arange(size - at)
    assert len(slots) <= K
    out["image_count"] = torch.tensor(len(slots))
    slots += [family.blank()] * (K - len(slots))
    if "image_grid_thw" in slots[0]:  # each slot the first bucket's patches, an image's own first
        patches = family.blank()["pixel_values"].shape[0]
        slots = [dict(slot, pixel_values=torch.nn.functional.pad(slot["pixel_values"],
                                                                 (0, 0, 0, patches - slot["pixel_values"].shape[0])))
                 for slot in slots]
    for key in slots[0]:
        out[key] = torch.cat([slot[key] for slot in slots])
    return out


collate = ImageCollator()
"""Blocks stacked into a batch, the image slots of the whole batch real images first (part B's
collator, kinds/vlm/data/blocks.py)."""


def packed_loss(model, batch: dict) -> torch.Tensor:
    """The loss sum of a batch through the training path: the static merge, PackedInputs."""
    static_image_merge(model)
    inputs = model_input_names(model)
    batch = PackedInputs(model, Precision(), inputs)(batch)
    with static_batches(image_model(model)):  # as training/prepare.Prepared.forward runs it
        loss = model(**{k: v for k, v in batch.items() if k in inputs}).loss
    return loss * (batch["labels"][:, 1:] != -100).sum()


def examples(family: Family) -> list[dict]:
    """Four examples with 1, 0, 2 and 1 images."""
    return [family.encode(*TEXTS[i], images(family.family, count, seed=i))
            for i, count in enumerate((1, 0, 2, 1))]


def batches(family: Family, model, encoded: list[dict]) -> list[list[dict]]:
    """Two batches of two blocks: real images 1 and 2 (block 0: an example with one image and
    one without), then 0 and 1 (the padding slots of block 0 after block 1's real image)."""
    size = max(sum(e["input_ids"].shape[1] for e in encoded[:2]), encoded[2]["input_ids"].shape[1]) + 5
    return [[block(family, model, encoded[:2], size), block(family, model, encoded[2:3], size)],
            [block(family, model, encoded[1:2], size), block(family, model, encoded[3:4], size)]]


def gradients(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def compare(reference_model, model, reference: torch.Tensor, ours: torch.Tensor) -> None:
    assert torch.allclose(ours, reference, rtol=1e-5, atol=1e-5), (ours.item(), reference.item())
    reference.backward()
    ours.backward()
    expected, got = gradients(reference_model), gradients(model)
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        # float rounding grows with the tensor's scale (Gemma 3's projector gradients reach 1e3)
        scale = max(1.0, float(grad.abs().max()))
        assert torch.allclose(got[name], grad, rtol=1e-4, atol=1e-5 * scale), name


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_blocks_give_transformers_per_example_loss_and_gradients(family, vlm_folders):  # noqa: F811
    """Four examples (1, 0, 2, 1 images) in four blocks of K=2 slots, two batches: the loss sum
    and every gradient equal transformers' own forward on each example alone."""
    f = Family(family, vlm_folders(family))
    reference_model, model = f.model, copy.deepcopy(f.model)
    encoded = examples(f)
    reference = sum(f.reference(reference_model, e) for e in encoded[:3]) + \
        sum(f.reference(reference_model, e) for e in encoded[1:2] + encoded[3:4])
    first, second = batches(f, model, encoded)
    assert [int(b["image_count"]) for b in first + second] == [1, 2, 0, 1]
    ours = packed_loss(model, collate(first)) + packed_loss(model, collate(second))
    compare(reference_model, model, reference, ours)
    assert "get_placeholder_mask" in vars(model.model) and "get_placeholder_mask" not in vars(reference_model.model)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpacked_rows_give_transformers_per_example_loss(family, vlm_folders):  # noqa: F811
    """One example per row (--no-packing: the same block format, one example a block, K the most
    images of one example), padded to one length: the same sums."""
    f = Family(family, vlm_folders(family))
    reference_model, model = f.model, copy.deepcopy(f.model)
    encoded = examples(f)
    reference = sum(f.reference(reference_model, e) for e in encoded)
    size = max(e["input_ids"].shape[1] for e in encoded) + 3
    rows = [block(f, model, [e], size) for e in encoded]
    ours = packed_loss(model, collate(rows[:2])) + packed_loss(model, collate(rows[2:]))
    compare(reference_model, model, reference, ours)


def test_gemma3_needs_its_images_seen_both_ways(vlm_folders):  # noqa: F811
    """Without the bidirectional image rule (the plain block-causal mask), Gemma 3's packed loss
    is not transformers' own: the rule is needed, not incidental."""
    f = Family("gemma3", vlm_folders("gemma3"))
    model = copy.deepcopy(f.model)
    encoded = examples(f)
    reference = sum(f.reference(f.model, e) for e in encoded[:3])
    batch = collate(batches(f, model, encoded)[0])
    with torch.no_grad():
        assert torch.allclose(packed_loss(model, dict(batch)), reference, rtol=1e-5, atol=1e-5)
        static_image_merge(model)
        packed = PackedInputs(model, Precision(), model_input_names(model))
        packed.mask.image_token = None  # the plain block-causal mask
        plain = packed(dict(batch))
        inputs = model_input_names(model)
        loss = model(**{k: v for k, v in plain.items() if k in inputs}).loss
        causal = loss * (batch["labels"][:, 1:] != -100).sum()
    assert abs(causal.item() - reference.item()) > 1e-3


def test_gemma3_sliding_layers_keep_their_window(tmp_path):
    """A Gemma 3 whose sliding window (8 tokens) is shorter than its examples: the block's
    sliding layers get their own mask (a dict by layer type), and the packed sum is still
    transformers' own; one 4-D mask for every layer (transformers' use of a given mask) is not."""
    folder = tiny_vlm_folder(tmp_path / "gemma3", "gemma3")
    config = transformers.AutoConfig.from_pretrained(folder)
    config.text_config.sliding_window = 8
    config.text_config.layer_types = ["sliding_attention", "full_attention"]
    config.save_pretrained(folder)
    f = Family("gemma3", folder)
    model = copy.deepcopy(f.model)
    encoded = examples(f)
    reference = sum(f.reference(f.model, e) for e in encoded[:3])
    batch = collate(batches(f, model, encoded)[0])
    static_image_merge(model)
    packed = PackedInputs(model, Precision(), model_input_names(model))(dict(batch))
    assert set(packed["attention_mask"]) == {"full_attention", "sliding_attention"}
    with torch.no_grad():
        assert torch.allclose(packed_loss(model, dict(batch)), reference, rtol=1e-5, atol=1e-5)
        inputs = model_input_names(model)
        one = dict(packed, attention_mask=packed["attention_mask"]["full_attention"])
        loss = model(**{k: v for k, v in one.items() if k in inputs}).loss
    assert abs((loss * (batch["labels"][:, 1:] != -100).sum()).item() - reference.item()) > 1e-3


def test_static_merge_is_idempotent_and_keeps_the_model(vlm_folders):  # noqa: F811
    """Under PEFT's adapters: found through the wrapper, done once, every parameter name kept;
    a text model is left alone."""
    peft = pytest.importorskip("peft")
    f = Family("llava", vlm_folders("llava"))
    model = peft.get_peft_model(f.model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    names = [n for n, _ in model.named_parameters()]
    assert static_image_merge(model) and static_image_merge(model)
    inner = model.base_model.model.model
    assert inner.get_placeholder_mask.__func__ is vars(inner)["get_placeholder_mask"].__func__
    assert [n for n, _ in model.named_parameters()] == names
    text = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    assert not static_image_merge(text)


@pytest.mark.parametrize("sizes", [[(112, 112), (56, 224), (224, 56)], [(84, 84), (28, 252), (252, 28)]],
                         ids=["whole-windows", "partial-windows"])
def test_qwen_tower_static_inputs_equal_transformers(sizes):
    """Qwen2.5-VL's image features with the tower's grid inputs precomputed and its attention
    over all images at once (one patch count, buckets of different shapes, 56-pixel windows whole
    or partial): transformers' own, image by image."""
    from ...vlm_fixtures import tiny_vlm_config, vlm_tokenizer, image_processor

    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_vlm_config("qwen2_5_vl", vlm_tokenizer()))
    processor = image_processor("qwen2_5_vl")
    processor.min_pixels, processor.max_pixels = 28 * 28, 336 * 336
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes + sizes[:1]]
    inputs = processor(images=pictures, return_tensors="pt")
    assert len({tuple(g) for g in inputs["image_grid_thw"].tolist()}) == 3
    expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    static = copy.deepcopy(model)
    static_image_merge(static)
    with static_batches(image_model(static)):
        got = static.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-6)


def test_outside_a_run_qwen_takes_images_of_any_size():
    """A model trained through the Python API keeps the swaps: outside hputrain's forwards
    (static_batches), images of different patch counts (what generate gets) are transformers'
    own features, where the static path would split them wrongly."""
    from ...vlm_fixtures import tiny_vlm_config, vlm_tokenizer, image_processor

    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_vlm_config("qwen2_5_vl", vlm_tokenizer()))
    rng = np.random.default_rng(1)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(56, 56), (56, 112)]]
    inputs = image_processor("qwen2_5_vl")(images=pictures, return_tensors="pt")
    assert inputs["image_grid_thw"].prod(-1).tolist() == [16, 32]
    expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    static_image_merge(model)
    got = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert [len(g) for g in got] == [len(e) for e in expected] == [4, 8]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


# -- Qwen2.5-VL's static tower: slots of fewer tokens, windows, a changed transformers (issue 47) ---

def qwen_inputs(sizes, slot_patches: int = 64, seed: int = 0) -> tuple[dict, list[dict]]:
    """Random images of `sizes` ((height, width)) through the image processor one by one, and the
    slots hputrain's blocks make of them: each image's patches, then blank ones up to
    `slot_patches`."""
    from ...vlm_fixtures import image_processor

    rng = np.random.default_rng(seed)
    processor = image_processor("qwen2_5_vl")
    alone = [processor(images=[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))],
                       return_tensors="pt") for h, w in sizes]
    pad = torch.nn.functional.pad
    slots = {"pixel_values": torch.cat([pad(a["pixel_values"], (0, 0, 0, slot_patches - a["pixel_values"].shape[0]))
                                        for a in alone]),
             "image_grid_thw": torch.cat([a["image_grid_thw"] for a in alone])}
    return slots, alone


def tiny_qwen():
    from ...vlm_fixtures import tiny_vlm_config, vlm_tokenizer

    torch.manual_seed(0)
    return transformers.AutoModelForImageTextToText.from_config(tiny_vlm_config("qwen2_5_vl", vlm_tokenizer()))


def test_qwen_slots_of_fewer_tokens_give_each_images_features():
    """Buckets of 9, 12, 16 and 9 tokens in slots of 16 (64 patches, the rest blank): the
    features come back every image's own first, in order, each equal to transformers' on the
    image alone; the slots' blank ones after them."""
    model = tiny_qwen()
    slots, alone = qwen_inputs([(84, 84), (112, 112), (56, 168), (28, 252)])
    expected = [model.model.get_image_features(a["pixel_values"], a["image_grid_thw"]).pooler_output[0]
                for a in alone]
    assert [len(e) for e in expected] == [9, 16, 12, 9]
    static = copy.deepcopy(model)
    static_image_merge(static)
    with static_batches(image_model(static)):
        got = torch.cat(static.model.get_image_features(**slots).pooler_output)
    assert got.shape[0] == 4 * 16
    assert torch.allclose(got[:46], torch.cat(expected), atol=1e-6)


def test_qwen_windowed_layers_attend_per_window(monkeypatch):
    """The windowed layers run their attention window by window ([images x windows, heads,
    window, window]: 16 patches a window here, of 64 an image), the full-attention layer
    image by image; the features are still transformers' own (its windowed attention)."""
    model = tiny_qwen()
    slots, alone = qwen_inputs([(112, 112), (56, 224), (84, 84)])
    expected = torch.cat([model.model.get_image_features(a["pixel_values"], a["image_grid_thw"]).pooler_output[0]
                          for a in alone])
    static = copy.deepcopy(model)
    static_image_merge(static)
    modeling = sys.modules[type(static.model.visual).__module__]
    interface, shapes = modeling.ALL_ATTENTION_FUNCTIONS.get_interface, []

    def watched(name, default):
        attend = interface(name, default)

        def attention(module, query, *args, **kwargs):
            shapes.append(tuple(query.shape))
            return attend(module, query, *args, **kwargs)
        return attention

    monkeypatch.setattr(modeling.ALL_ATTENTION_FUNCTIONS, "get_interface", watched)
    with static_batches(image_model(static)):
        got = torch.cat(static.model.get_image_features(**slots).pooler_output)
    tower = static.model.visual
    windowed = [i for i in range(len(tower.blocks)) if i not in tower.fullatt_block_indexes]
    assert windowed and len(shapes) == len(tower.blocks)
    heads = tower.config.num_heads
    for i, shape in enumerate(shapes):
        if i in windowed:  # at most 6 windows of 2 x 2 merged tokens (16 patches) a slot
            assert shape[:3] == (3 * 6, heads, 16), shape
        else:
            assert shape[:3] == (3, heads, 64), shape
    assert torch.allclose(got[:16 + 16 + 9], expected, atol=1e-6)


def _renamed_qkv(tower):
    """A newer attention module's layout: its qkv projection under another name."""
    for block in tower.blocks:
        block.attn.to_qkv = block.attn.qkv
        del block.attn.qkv


def _copied_window_splits(tower, monkeypatch):
    """A newer tower that hands its windowed layers a copy of the window split points."""
    modeling = sys.modules[type(tower).__module__]
    original = modeling.get_vision_window_index

    def copied(*args, **kwargs):
        index, splits = original(*args, **kwargs)
        return index, splits.clone()
    monkeypatch.setattr(modeling, "get_vision_window_index", copied)


def _skipped_attention(tower, monkeypatch):
    """A newer block that calls its attention by another route than the module's forward."""
    for block in tower.blocks:
        monkeypatch.setattr(block, "forward", lambda hidden_states, **kwargs: hidden_states + block.mlp(hidden_states))


@pytest.mark.parametrize("change, match", [
    ("renamed qkv", r"block 0 of its vision tower \(\w+\) has no attn\.qkv"),
    ("no fullatt_block_indexes", r"its vision tower \(\w+\) has no fullatt_block_indexes"),
    ("copied window splits", r"a windowed layer of its tower was handed split points \(cu_seqlens\) other than "
                             r"the precomputed window ones"),
    ("attention skipped", r"its vision tower ran 0 of its 2 attention layers through the attention module's forward"),
])
def test_a_changed_qwen_tower_is_one_line(change, match, monkeypatch):
    """A transformers whose Qwen2.5-VL tower is laid out otherwise than the static tower reads it
    (stand-ins for what a newer one might change) is one line naming the change, never a silent
    fall back to full attention or to transformers' own host reads."""
    model = tiny_qwen()
    tower = model.model.visual
    if change == "renamed qkv":
        _renamed_qkv(tower)
    elif change == "no fullatt_block_indexes":
        del tower.fullatt_block_indexes
    elif change == "copied window splits":
        _copied_window_splits(tower, monkeypatch)
    else:
        _skipped_attention(tower, monkeypatch)
    slots, _ = qwen_inputs([(112, 112), (56, 224)])
    with pytest.raises(InputError, match=r"^transformers [\d.]+\w*'s Qwen2.5-VL vision tower is not the one hputrain's "
                                         r"static tower follows \(transformers 5.24\): " + match):
        static_image_merge(model)
        with static_batches(image_model(model)):
            model.model.get_image_features(**slots)
