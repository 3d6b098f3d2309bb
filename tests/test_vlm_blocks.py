"""Image examples in fixed blocks (issue 41, data/vision/blocks.py): packing with image slots,
positions restarting per example (Qwen's equal to transformers' get_rope_index of each example
alone), labels, the collator's real-first slot order checked by transformers' own
masked_scatter of image features, unpacked rows, validation, and blocks of the tiny folders."""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hputrain.data import packing
from hputrain.data.vision import blocks
from hputrain.errors import InputError
from hputrain.models.vision import image_token_id, vision_family

from .vlm_fixtures import FAMILIES, tiny_vlm_config, vlm_tokenizer

transformers = pytest.importorskip("transformers")

TOKENS_PER_IMAGE = 4
QWEN_GRIDS = ((1, 4, 4), (1, 2, 8))
"""The stand-in's Qwen buckets: square and wide, 16 patches (4 image tokens) each."""


@dataclass
class Example:
    """The fields of encode.ImageExample the blocks read."""

    input_ids: np.ndarray
    labels: np.ndarray
    images: list
    buckets: list


class StandIn:
    """A Processing whose pixel values name their image: every value of image `ref` is `ref`."""

    def __init__(self, family: str) -> None:
        self.tokenizer = vlm_tokenizer()
        self.config = tiny_vlm_config(family, self.tokenizer)
        self.family = vision_family(self.config)
        self.buckets = [0, 1] if family == "qwen2_5_vl" else [0]

    def pixels(self, ref, bucket: int) -> dict:
        if self.family.positions != "3d":
            return {"pixel_values": np.full((3, 28, 28), float(ref), dtype=np.float32)}
        grid = QWEN_GRIDS[bucket]
        return {"pixel_values": np.full((16, 1176), float(ref), dtype=np.float32),
                "image_grid_thw": np.asarray(grid)}

    def blank(self, bucket: int) -> dict:
        return self.pixels(-1, bucket)


def image_tokens(processing, family: str) -> list[int]:
    ids = processing.tokenizer.convert_tokens_to_ids
    token = image_token_id(processing.config)
    if family == "llava":
        return [token] * TOKENS_PER_IMAGE
    if family == "gemma3":
        return [ids("<start_of_image>")] + [token] * TOKENS_PER_IMAGE + [ids("<end_of_image>")]
    return [ids("<|vision_start|>")] + [token] * TOKENS_PER_IMAGE + [ids("<|vision_end|>")]


def make_examples(processing, family: str, count: int, seed: int = 0, most_images: int = 3,
                  answer=(2, 30)) -> list[Example]:
    """`count` examples: a prompt of text and 0 to most_images images (refs numbered from 1),
    then a learned answer."""
    rng = np.random.default_rng(seed)
    examples, ref = [], 1
    for _ in range(count):
        ids, labels, refs, buckets = list(rng.integers(10, 60, size=rng.integers(1, 6))), None, [], []
        for _ in range(int(rng.integers(0, most_images + 1))):
            ids += image_tokens(processing, family) + list(rng.integers(10, 60, size=2))
            refs.append(ref)
            buckets.append(int(rng.integers(0, len(processing.buckets))))
            ref += 1
        learned = list(rng.integers(10, 60, size=rng.integers(*answer)))
        labels = [-100] * len(ids) + learned
        examples.append(Example(np.asarray(ids + learned, dtype=np.int32),
                                np.asarray(labels, dtype=np.int32), refs, buckets))
    return examples


@pytest.fixture(scope="module")
def stand_ins():
    made = {}

    def get(family):
        if family not in made:
            made[family] = StandIn(family)
        return made[family]
    return get


def segments(block: dict):
    """(start, length) of each example in a block."""
    at = 0
    for n in block["seq_lens"].tolist():
        if n:
            yield at, n
            at += n


# -- packing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("slots", [1, 2, 3, 5])
def test_packing_keeps_tokens_slots_and_whole_examples(stand_ins, slots):
    processing = stand_ins("llava")
    examples = make_examples(processing, "llava", 60, most_images=min(slots, 3))
    layout = blocks.BlockLayout(processing, slots)
    made, stats = blocks.pack_images(layout, examples, np.arange(len(examples)), 64, slots)
    seen = []
    for index, block in enumerate(made):
        assert block["input_ids"].shape == (64,)
        assert int(block["seq_lens"].sum()) <= 64
        assert int(block["image_count"]) == made.images(index) <= slots
        assert block["pixel_values"].shape == (slots, 3, 28, 28)
        start, end = made.members.offsets[index], made.members.offsets[index + 1]
        for i, (at, n) in zip(made.members.values[start:end].tolist(), segments(block)):
            assert n == min(len(examples[i].input_ids), 64)
            assert block["input_ids"][at:at + n].tolist() == examples[i].input_ids[:n].tolist()
            seen.append(i)
    kept = [i for i, e in enumerate(examples) if packing.first_learned(e.labels) < min(len(e.labels), 64)]
    assert sorted(seen) == kept and stats.examples == len(kept)
    assert stats.images == sum(len(examples[i].images) for i in kept)
    assert stats.padding_slots == len(made) * slots - stats.images
    again, _ = blocks.pack_images(layout, examples, np.arange(len(examples)), 64, slots)
    assert np.array_equal(again.members.values, made.members.values)
    assert np.array_equal(again.members.offsets, made.members.offsets)


def test_image_packing_of_examples_without_images_is_text_packing():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 100, size=300).tolist()
    counts = rng.integers(0, 3, size=300).tolist()
    text = packing.best_fit_decreasing(lengths, 100)
    assert packing.best_fit_decreasing(lengths, 100, [0] * 300, slots=3) == text
    limited = packing.best_fit_decreasing(lengths, 100, counts, slots=2)
    assert sorted(i for b in limited for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 100 and sum(counts[i] for i in b) <= 2 for b in limited)
    assert len(limited) >= len(text)


def test_cut_after_the_last_image_and_nothing_to_learn(stand_ins):
    processing = stand_ins("llava")
    image = image_tokens(processing, "llava")
    long = Example(np.asarray([11] + image + list(range(20, 60)), dtype=np.int32),
                   np.asarray([-100] * 5 + list(range(20, 60)), dtype=np.int32), [1], [0])
    prompt_only = Example(np.asarray([11] + image + list(range(20, 60)), dtype=np.int32),
                          np.asarray([-100] * 20 + list(range(35, 60)), dtype=np.int32), [2], [0])
    kept, cut, stats = blocks.cut_examples([long, prompt_only], [0, 1], 16, image[0])
    assert kept.tolist() == [0] and cut.tolist() == [16]
    assert (stats.truncated, stats.nothing_to_learn, stats.labels_cut) == (2, 1, 29 + 25)
    with pytest.raises(InputError, match="past --block-size 4"):
        blocks.cut_examples([long], [0], 4, image[0])


def test_default_slots_and_refusal(stand_ins):
    processing = stand_ins("llava")
    examples = make_examples(processing, "llava", 40, seed=1)
    counts = [len(e.images) for e in examples]
    lengths = [min(len(e.input_ids), 128) for e in examples]
    token_blocks = len(packing.best_fit_decreasing(lengths, 128))
    expected = max(-(-sum(counts) // token_blocks), max(counts))
    assert blocks.default_slots(counts, lengths, 128, max(counts)) == expected
    assert blocks.default_slots([0, 0], [5, 5], 128, 0) == 1  # a slot even without images
    assert blocks.default_slots([1, 1, 1, 1], [5, 5, 5, 5], 128, 1) == 4
    with pytest.raises(InputError, match=r"^--image-slots 2 is fewer than the 3 images of one example"):
        blocks.pack_images(blocks.BlockLayout(processing, 2), examples, np.arange(40), 128, 2)
    with pytest.raises(InputError, match="at least 1"):
        blocks.check_slots(0, 0)


# -- block tensors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_block_labels_and_positions(stand_ins, family):
    processing = stand_ins(family)
    examples = make_examples(processing, family, 12, seed=2)
    layout = blocks.BlockLayout(processing, 4)
    made, _ = blocks.pack_images(layout, examples, np.arange(len(examples)), 96, 4)
    token = image_token_id(processing.config)
    model = None
    if family == "qwen2_5_vl":
        model = transformers.Qwen2_5_VLModel(processing.config)
    for index, block in enumerate(made):
        start = made.members.offsets[index]
        three = block["position_ids"].dim() == 2
        assert block["position_ids"].shape[-1] == 96 and three == (family == "qwen2_5_vl")
        for k, (at, n) in enumerate(segments(block)):
            example = examples[made.members.values[start + k]]
            labels = block["labels"][at:at + n]
            expected = torch.tensor(example.labels[:n], dtype=torch.long)
            expected[0] = -100
            expected[torch.tensor(example.input_ids[:n]) == token] = -100
            assert labels.tolist() == expected.tolist()
            positions = block["position_ids"][..., at:at + n]
            if model is None:
                assert positions.tolist() == list(range(n))
                continue
            ids = torch.tensor(example.input_ids[:n], dtype=torch.long)[None]
            grids = torch.tensor([QWEN_GRIDS[b] for b in example.buckets]) if example.images else None
            reference, _ = model.get_rope_index(ids, mm_token_type_ids=(ids == token).int(),
                                                image_grid_thw=grids)
            assert torch.equal(positions, reference[:, 0])
        used = int(block["seq_lens"].sum())
        assert block["position_ids"][..., used:].tolist() == (
            [list(range(96 - used))] * 3 if three else list(range(96 - used)))
        assert (block["labels"][used:] == -100).all()


# -- the collator -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_collator_fills_each_image_run_with_its_image(stand_ins, family):
    """transformers' masked_scatter of the batch's image features (one value per image: its ref)
    puts each image's value on its own image tokens: the k-th run gets the k-th real image."""
    processing = stand_ins(family)
    examples = make_examples(processing, family, 10, seed=4)
    layout = blocks.BlockLayout(processing, 6)
    made, _ = blocks.pack_images(layout, examples, np.arange(len(examples)), 80, 6)
    items = [made[i] for i in range(len(made))]
    assert len({int(b["image_count"]) for b in items}) > 1
    collator = pickle.loads(pickle.dumps(blocks.ImageCollator(layout.pad_token_id)))
    batch = collator(items)
    assert "image_count" not in batch
    count = sum(int(b["image_count"]) for b in items)
    per_image = batch["pixel_values"].reshape(len(items) * 6, -1)
    assert (per_image[count:] == -1).all()  # blank slots last
    features = per_image[:, :1].repeat_interleave(TOKENS_PER_IMAGE, 0).expand(-1, 8)  # [images * T, D]
    if family == "qwen2_5_vl":
        grids = [tuple(g) for g in batch["image_grid_thw"][:count].tolist()]
        expected = [QWEN_GRIDS[b] for i in range(len(items)) for k in range(made.members.offsets[i],
                                                                          made.members.offsets[i + 1])
                    for b in examples[made.members.values[k]].buckets]
        assert grids == expected
    token = image_token_id(processing.config)
    mask = (batch["input_ids"] == token)[..., None].expand(-1, -1, 8)
    embeds = torch.zeros(*batch["input_ids"].shape, 8).masked_scatter(mask, features)
    for i in range(len(items)):
        start, end = made.members.offsets[i], made.members.offsets[i + 1]
        refs = [r for k in range(start, end) for r in examples[made.members.values[k]].images]
        where = torch.nonzero(batch["input_ids"][i] == token).flatten()
        assert embeds[i, where, 0].tolist() == [float(r) for r in refs for _ in range(TOKENS_PER_IMAGE)]


# -- unpacked ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_unpacked_rows(stand_ins, family):
    processing = stand_ins(family)
    examples = make_examples(processing, family, 9, seed=5)
    most = max(len(e.images) for e in examples)
    layout = blocks.BlockLayout(processing, most)
    rows, stats = blocks.unpacked_images(layout, examples, np.arange(9), 128, most)
    lengths = [32, 64, 96, 128]
    assert len(rows) == stats.blocks == 9
    for i, row in enumerate(rows):
        n = len(examples[i].input_ids)
        assert row["input_ids"].shape == (min(x for x in lengths if x >= n),)
        assert row["seq_lens"].tolist()[:2] == [n, 0]
        assert row["input_ids"][:n].tolist() == examples[i].input_ids.tolist()
    items = [rows[i] for i in range(3)]
    batch = blocks.ImageCollator(layout.pad_token_id)(items)
    width = max(r["input_ids"].shape[0] for r in items)
    assert batch["input_ids"].shape == (3, width)
    for i, row in enumerate(items):
        n = int(row["seq_lens"].sum())
        assert batch["position_ids"][i, ..., n:].tolist() == (
            [list(range(width - n))] * 3 if family == "qwen2_5_vl" else list(range(width - n)))
        assert (batch["input_ids"][i, n:] == layout.pad_token_id).all()
        assert (batch["labels"][i, n:] == -100).all()
        assert batch["seq_lens"][i].tolist() == row["seq_lens"].tolist() + [0] * (width - row["seq_lens"].shape[0])
