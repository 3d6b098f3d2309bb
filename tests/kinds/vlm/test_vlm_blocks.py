"""Image examples in fixed blocks (issue 41, kinds/vlm/data/blocks.py): packing with image slots,
positions restarting per example (Qwen's equal to transformers' get_rope_index of each example
alone), labels, the collator's real-first slot order checked by transformers' own
masked_scatter of image features, unpacked rows, validation, and blocks of the tiny folders."""
from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hputrain.data import packing
from hputrain.kinds.vlm.data import blocks
from hputrain.kinds.vlm.data.encode import ImageExample, Processing, encode_split
from hputrain.kinds.vlm.data.loading import load_image_data
from hputrain.kinds.vlm.data.rows import split_rows
from hputrain.errors import InputError
from hputrain.kinds.vlm.family import image_token_id, vision_family

from ...vlm_fixtures import image_data, vlm_folders  # noqa: F401
from ...vlm_fixtures import FAMILIES, save_image_dataset, tiny_vlm_config, vlm_tokenizer

transformers = pytest.importorskip("transformers")

TOKENS_PER_IMAGE = 4
QWEN_GRIDS = ((1, 4, 4), (1, 2, 8))
"""The stand-in's Qwen buckets: square and wide, 16 patches (4 image tokens) each."""


def example(ids, labels, images, buckets, image_token: int) -> ImageExample:
    ids = np.asarray(ids, dtype=np.int32)
    at = np.flatnonzero(ids == image_token)
    return ImageExample(ids, np.asarray(labels, dtype=np.int32), list(images), list(buckets),
                        int(at[-1]) + 1 if len(at) else 0, "--dataset test line 1")


class StandIn:
    """A Processing whose pixel values name their image: every value of image `ref` is `ref`."""

    def __init__(self, family: str) -> None:
        self.tokenizer = vlm_tokenizer()
        self.config = tiny_vlm_config(family, self.tokenizer)
        self.family = vision_family(self.config)
        self.image_token_id = image_token_id(self.config)
        self.buckets = [0, 1] if family == "qwen2_5_vl" else [0]

    def pixels(self, ref, bucket: int, where: str | None = None) -> dict:
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
                  answer=(2, 30)) -> list[ImageExample]:
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
        examples.append(example(ids + learned, labels, refs, buckets, processing.image_token_id))
    return examples


@pytest.fixture(scope="module")
def stand_ins():
    made = {}

    def get(family):
        if family not in made:
            made[family] = StandIn(family)
        return made[family]
    return get


def pack(layout, examples, block_size: int):
    kept = blocks.cut_examples(examples, np.arange(len(examples)), block_size)
    return blocks.pack_images(layout, examples, kept, block_size)


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
    made, stats = pack(layout, examples, 64)
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
    again, _ = pack(layout, examples, 64)
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


def test_image_packing_takes_the_better_order():
    """Where lengths and image counts vary apart, the slots cost (almost) no block over a packing
    by tokens alone; longest first alone would need many more."""
    rng = np.random.default_rng(0)
    lengths, counts = rng.integers(100, 1500, size=3000).tolist(), rng.integers(0, 4, size=3000).tolist()
    text = len(packing.best_fit_decreasing(lengths, 4096))
    slots = blocks.default_slots(counts, lengths, 4096, 3)
    bins = blocks.fill_slots(lengths, counts, 4096, slots)
    assert sorted(i for b in bins for i in b) == list(range(3000))
    assert all(sum(lengths[i] for i in b) <= 4096 and sum(counts[i] for i in b) <= slots for b in bins)
    longest_first = len(packing.best_fit_decreasing(lengths, 4096, counts, slots))
    assert len(bins) <= text * 1.01 < longest_first * 0.95
    # Long examples are the ones with images: longest first is kept, as it does better there.
    rng = np.random.default_rng(2)
    counts = rng.integers(0, 4, size=3000)
    lengths, counts = (counts * 300 + rng.integers(50, 600, size=3000)).tolist(), counts.tolist()
    slots = blocks.default_slots(counts, lengths, 4096, 3)
    together = sorted(range(3000), key=lambda i: (-(lengths[i] * slots + counts[i] * 4096), i))
    longest_first = packing.best_fit_decreasing(lengths, 4096, counts, slots)
    assert blocks.fill_slots(lengths, counts, 4096, slots) == longest_first
    assert len(longest_first) < len(packing.best_fit_decreasing(lengths, 4096, counts, slots, order=together))


def test_cut_after_the_last_image_and_nothing_to_learn(stand_ins):
    processing = stand_ins("llava")
    image = image_tokens(processing, "llava")
    long = example([11] + image + list(range(20, 60)), [-100] * 5 + list(range(20, 60)), [1], [0], image[0])
    prompt_only = example([11] + image + list(range(20, 60)), [-100] * 20 + list(range(35, 60)), [2], [0],
                          image[0])
    kept = blocks.cut_examples([long, prompt_only], [0, 1], 16)
    assert kept.indices.tolist() == [0] and kept.lengths.tolist() == [16] and kept.counts.tolist() == [1]
    stats = kept.stats
    assert (stats.truncated, stats.nothing_to_learn, stats.labels_cut) == (2, 1, 29 + 25)
    with pytest.raises(InputError, match=r"^--dataset test line 1: .* last image ends at token 5, "
                                         r"past --block-size 4"):
        blocks.cut_examples([long], [0], 4)


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
        pack(blocks.BlockLayout(processing, 2), examples, 128)
    with pytest.raises(InputError, match="at least 1"):
        blocks.check_slots(0)


# -- block tensors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_block_labels_and_positions(stand_ins, family):
    processing = stand_ins(family)
    examples = make_examples(processing, family, 12, seed=2)
    layout = blocks.BlockLayout(processing, 4)
    made, _ = pack(layout, examples, 96)
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
    made, _ = pack(layout, examples, 80)
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
    rows, stats = blocks.unpacked_images(layout, examples, blocks.cut_examples(examples, np.arange(9), 128),
                                          128)
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
        more = width - row["seq_lens"].shape[0]
        assert batch["seq_lens"][i].tolist() == row["seq_lens"].tolist() + [0] * more


# -- the tiny folders, through load_image_data ---------------------------------------------------------

def rows_of(path):
    """The recipe's reading of a data set: (where, row, folder) of a split."""
    from hputrain.recipes.hf import data as hf_data

    return lambda split: split_rows(str(path), split, hf_data.records, hf_data.source_files)


def options(**flags):
    from hputrain.recipes.hf import HFOptions

    return HFOptions(model="unused", dataset="unused", dataset_num_proc=1, **flags)


@pytest.fixture(scope="module")
def processings(vlm_folders):
    made = {}

    def get(family):
        if family not in made:
            made[family] = Processing.load(vlm_folders(family))
        return made[family]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_folder_blocks(processings, image_data, family):
    """Packed blocks of the tiny folders hold encode_split's examples, their images' pixel
    values in slot order (blank slots: a blank image), Qwen's positions transformers' own."""
    processing = processings(family)
    path = image_data("messages")
    data = load_image_data(str(path), "messages", processing, 96, options(validation_split_percentage=0),
                           rows=rows_of(path))
    examples, counted = encode_split(rows_of(path)("train"), "messages", processing, options())
    assert data.rows.rows == counted.rows == 24 and data.stats.rows == 24
    assert data.stats.images == counted.images and data.stats.examples == len(examples)
    assert data.slots >= max(len(e.images) for e in examples)
    model = transformers.Qwen2_5_VLModel(processing.config) if family == "qwen2_5_vl" else None
    blank = processing.blank(0)["pixel_values"]
    for index in range(len(data.train)):
        block = data.train[index]
        start = data.train.members.offsets[index]
        parts = [examples[data.train.members.values[start + k]] for k in range(len(list(segments(block))))]
        images = [processing.pixels(ref, b) for e in parts for ref, b in zip(e.images, e.buckets)]
        assert int(block["image_count"]) == len(images)
        slots = block["pixel_values"].reshape(data.slots, *blank.shape)
        for k, pixels in enumerate(images):  # (Qwen: an image's own patches, then blank ones)
            own = pixels["pixel_values"]
            assert torch.equal(slots[k][:len(own)], own) and not slots[k][len(own):].any()
        assert all(torch.equal(slot, blank) for slot in slots[len(images):])
        for e, (at, n) in zip(parts, segments(block)):
            assert block["input_ids"][at:at + n].tolist() == e.input_ids[:n].tolist()
            if model is not None:
                ids = torch.tensor(e.input_ids[:n], dtype=torch.long)[None]
                grids = torch.stack([p["image_grid_thw"] for p in
                                     [processing.pixels(r, b) for r, b in zip(e.images, e.buckets)]]) \
                    if e.images else None
                kinds = (ids == processing.image_token_id).int()
                reference, _ = model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grids)
                assert torch.equal(block["position_ids"][:, at:at + n], reference[:, 0])
    batch = data.collator([data.train[i] for i in range(min(3, len(data.train)))])
    assert batch["input_ids"].shape == (min(3, len(data.train)), 96)
    again = pickle.loads(pickle.dumps(data.train))[0]  # as DataLoader workers started by spawn get it
    assert all(torch.equal(again[key], value) for key, value in data.train[0].items())


def test_validation_is_the_last_examples(processings, image_data):
    processing = processings("llava")
    path = image_data("messages")
    examples, _ = encode_split(rows_of(path)("train"), "messages", processing, options())
    data = load_image_data(str(path), "messages", processing, 128, options(validation_split_percentage=25),
                           rows=rows_of(path))
    held = max(1, len(examples) // 4)
    assert not data.own_validation
    assert sorted(data.validation.members.values.tolist()) == list(range(len(examples) - held, len(examples)))
    assert sorted(data.train.members.values.tolist()) == list(range(len(examples) - held))
    assert data.stats.examples == len(examples) and data.train.layout is data.validation.layout


def test_validation_split_of_a_dataset_dict(processings, tmp_path):
    datasets = pytest.importorskip("datasets")
    from hputrain.recipes.hf import data as hf_data

    saved = save_image_dataset(tmp_path / "one", rows=20)
    whole = datasets.load_from_disk(str(saved))
    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": whole.select(range(14)), "validation": whole.select(range(14, 20))}
                         ).save_to_disk(str(folder))
    processing = processings("gemma3")
    data = load_image_data(str(folder), "messages", processing, 128, options(), rows=rows_of(folder),
                           splits=hf_data.saved_splits(str(folder)))
    held, _ = encode_split(rows_of(folder)("validation"), "messages", processing, options())
    assert data.own_validation and data.rows.rows == 20
    assert sorted(data.validation.members.values.tolist()) == list(range(len(held)))
    assert [e.input_ids.tolist() for e in data.validation.examples] == [e.input_ids.tolist() for e in held]


def test_unpacked_slots_and_the_image_slots_refusal(processings, image_data):
    processing = processings("qwen2_5_vl")
    path = image_data("messages")
    examples, _ = encode_split(rows_of(path)("train"), "messages", processing, options())
    most = max(len(e.images) for e in examples)
    data = load_image_data(str(path), "messages", processing, 128,
                           options(packing=False, validation_split_percentage=0), rows=rows_of(path))
    assert data.slots == most and len(data.train) == len(examples)
    assert data.train[0]["image_grid_thw"].shape == (most, 3)
    fullest = next(e.where for e in examples if len(e.images) == most)
    with pytest.raises(InputError, match=rf"^--image-slots 1 is fewer than the {most} images of one example "
                                         rf"\({re.escape(fullest)}\): give --image-slots {most} or more"):
        load_image_data(str(path), "messages", processing, 128, options(image_slots=1), rows=rows_of(path))


def reference_inputs(example, n: int, processing) -> dict:
    """One encoded example cut to n tokens as transformers' model takes it alone (the
    processor's keys)."""
    ids = torch.tensor(example.input_ids[:n], dtype=torch.long)[None]
    labels = torch.tensor(example.labels[:n], dtype=torch.long)[None]
    labels[:, 0] = -100
    inputs = {"input_ids": ids, "labels": labels}
    pixels = [processing.pixels(ref, b) for ref, b in zip(example.images, example.buckets)]
    if pixels and "image_grid_thw" in pixels[0]:
        inputs["pixel_values"] = torch.cat([p["pixel_values"] for p in pixels])
        inputs["image_grid_thw"] = torch.stack([p["image_grid_thw"] for p in pixels])
    elif pixels:
        inputs["pixel_values"] = torch.stack([p["pixel_values"] for p in pixels])
    kinds = (ids == processing.image_token_id).long()
    if processing.family.positions == "3d":
        inputs["mm_token_type_ids"] = kinds.int()
    elif processing.family.bidirectional_images:
        inputs["token_type_ids"] = kinds
    return inputs


@pytest.mark.parametrize("family", FAMILIES)
def test_data_path_blocks_give_transformers_per_example_loss(processings, vlm_folders, image_data, family):
    """The blocks load_image_data makes of the tiny data (some examples cut after their last
    image), collated two at a time, through the training forward (the static image merge,
    PackedInputs): the loss sum of transformers' own forward on each (cut) example alone."""
    from hputrain.data.batching import model_input_names
    from hputrain.execution.precision import Precision
    from hputrain.kinds.vlm.execution import image_model, static_batches, static_image_merge
    from hputrain.training.packed import PackedInputs

    processing = processings(family)
    path = image_data("messages")
    data = load_image_data(str(path), "messages", processing, 160, options(validation_split_percentage=0),
                           rows=rows_of(path))
    assert data.stats.truncated > 0 and data.stats.padding_slots > 0
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_pretrained(vlm_folders(family)).eval()
    with torch.no_grad():
        reference = 0.0
        for i, n in zip(data.train.members.values.tolist(), data.train.lengths.tolist()):
            inputs = reference_inputs(data.train.examples[i], n, processing)
            reference += model(**inputs).loss * (inputs["labels"][:, 1:] != -100).sum()
        static_image_merge(model)
        names = model_input_names(model)
        packed = PackedInputs(model, Precision(), names)
        ours = 0.0
        for start in range(0, len(data.train), 2):
            pair = [data.train[i] for i in range(start, start + 2) if i < len(data.train)]
            batch = packed(data.collator(pair))
            with static_batches(image_model(model)):  # as the Trainer's forward runs it
                loss = model(**{k: v for k, v in batch.items() if k in names}).loss
            ours += loss * (batch["labels"][:, 1:] != -100).sum()
    assert torch.allclose(ours, reference, rtol=1e-5, atol=1e-5), (float(ours), float(reference))


@pytest.mark.parametrize("saved", [False, True], ids=["paths", "save_to_disk"])
def test_cached_examples_give_the_same_blocks(processings, image_data, tmp_path, saved):
    """A second load reads the cached examples (image paths, or the images of a save_to_disk
    data set) without reading a row, and makes the same blocks; other loss flags are another
    cache."""
    processing = processings("qwen2_5_vl")
    path = save_image_dataset(tmp_path / "saved", rows=12) if saved else image_data("messages")

    def key(split):
        return f"{path} {split}"

    def unread(split):
        raise AssertionError("the rows were read again")

    first = load_image_data(str(path), "messages", processing, 96, options(validation_split_percentage=20),
                            tmp_path / "cache", rows=rows_of(path), cache_key=key)
    second = load_image_data(str(path), "messages", processing, 96, options(validation_split_percentage=20),
                             tmp_path / "cache", rows=unread, cache_key=key)
    assert not first.from_cache and second.from_cache and second.cache_file == first.cache_file
    assert second.rows == first.rows and second.stats == first.stats
    for made, again in ((first.train, second.train), (first.validation, second.validation)):
        assert len(made) == len(again)
        for i in range(len(made)):
            assert all(torch.equal(again[i][k], v) for k, v in made[i].items())
    for a, b in zip(first.train.examples, second.train.examples, strict=True):
        assert (a.input_ids.tolist(), a.labels.tolist(), a.images, a.buckets, a.images_end, a.where) == \
            (b.input_ids.tolist(), b.labels.tolist(), b.images, b.buckets, b.images_end, b.where)
    kinds = {type(ref).__name__ for e in second.train.examples for ref in e.images}
    assert kinds == ({"SavedImage"} if saved else {"str"})
    other = load_image_data(str(path), "messages", processing, 96, options(assistant_only_loss=False),
                            tmp_path / "cache", rows=rows_of(path), cache_key=key)
    assert not other.from_cache and other.cache_file != first.cache_file


# -- pixel buckets (issue 47, item 18) ---------------------------------------------------------------

def test_resize_to_bucket_is_trainings_resize():
    """The one resize rule training and generate share: the bucket nearest the image's aspect
    ratio, at its size, with the processor's filter; a fixed-size family's image as it is."""
    from PIL import Image

    from hputrain.kinds.vlm.data.buckets import make_buckets, resize_to_bucket

    from ...vlm_fixtures import image_processor

    qwen = vision_family(tiny_vlm_config("qwen2_5_vl", vlm_tokenizer()))
    buckets = make_buckets(qwen, image_processor("qwen2_5_vl"), ["112x112", "224x56", "56x224"])
    rng = np.random.default_rng(0)
    for width, height in [(90, 20), (20, 90), (60, 50)]:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        index = buckets.choose(width, height)
        resized = resize_to_bucket(image, buckets)
        assert resized.size == buckets.sizes[index]
        assert np.array_equal(np.asarray(resized), np.asarray(image.resize(buckets.sizes[index], resample=3)))
    llava = vision_family(tiny_vlm_config("llava", vlm_tokenizer()))
    fixed = make_buckets(llava, image_processor("llava"), tokens_of=lambda w, h: 4)
    image = Image.new("RGB", (90, 20))
    assert resize_to_bucket(image, fixed) is image and fixed.distortion(90, 20) == 0.0
    assert buckets.distortion(224, 56) == 0.0 and abs(buckets.distortion(112, 56) - 1.0) < 1e-9


def crowded_data(folder: Path, many: int = 6) -> Path:
    """12 rows of one image each, one row of `many` images, and a row whose image is 10:1 (200 x
    20 pixels), as a data file in `folder`."""
    import json

    from PIL import Image

    from ...vlm_fixtures import QUESTIONS

    (folder / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = []
    for i, (width, height) in enumerate([(60, 60), (120, 30), (30, 120), (80, 60)] * 2):  # bucket shapes
        names.append(f"images/{i}.png")
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / names[-1])
    Image.new("RGB", (200, 20), (200, 40, 40)).save(folder / "images" / "banner.png")
    rows = [[names[i % len(names)]] for i in range(12)] + [names[:many], ["images/banner.png"]]
    lines = [{"messages": [{"role": "user", "content": [{"type": "image"} for _ in used]
                            + [{"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "a few words"}]}],
              "images": used} for i, used in enumerate(rows)]
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_blank_slots_and_distorted_images_are_warned_of(processings, tmp_path):
    """Issue 47, items 18 and 19: one row of 6 images sets K = 6 for every row (--no-packing), so
    most slots are blank: the warning says so, what set K (that row) and what would lower it;
    packed, the blocks share the slots and fewer are blank. An image of 10:1, which the tiny
    folder's buckets (at most 4:1) squash by 150%, is warned of with its row."""
    processing = processings("qwen2_5_vl")
    path = crowded_data(tmp_path)
    unpacked = load_image_data(str(path), "messages", processing, 256,
                               options(packing=False, validation_split_percentage=0), rows=rows_of(path))
    stats = unpacked.stats
    assert stats.slots == 6 and stats.images == 19 and stats.blocks == 14
    assert stats.padding_slot_fraction == pytest.approx((14 * 6 - 19) / (14 * 6))
    blank, distorted = stats.warnings(packed=False)
    assert re.fullmatch(
        r"77% of the image slots are blank images, each run through the vision tower as a real one: 6 "
        r"slots a block \(set by the 6 images of one example, --dataset \S+data.jsonl line 13\) for 1.4 "
        r"images a block on average; leave out or split the 1 example with more than 2 images, and K can "
        r"come down with them; or pack \(leave out --no-packing\): a block's slots then hold several "
        r"examples' images", blank), blank
    assert re.fullmatch(r"1 example has an image whose pixel bucket changes its aspect ratio by more than 10% "
                        r"\(the most: 150%, --dataset \S+data.jsonl line 14\): give --image-buckets with a "
                        r"size of that shape \(at most 11:1\), or crop such images", distorted), distorted
    packed = load_image_data(str(path), "messages", processing, 256, options(validation_split_percentage=0),
                             rows=rows_of(path))
    assert packed.stats.padding_slot_fraction < stats.padding_slot_fraction
    given = load_image_data(str(path), "messages", processing, 256,
                            options(packing=False, validation_split_percentage=0, image_slots=9),
                            rows=rows_of(path))
    assert "(set by --image-slots) for 1.4 images a block on average; --image-slots 6 would do" \
        in given.stats.warnings(packed=False)[0]


@pytest.mark.slow
def test_the_run_header_says_the_buckets_and_warns(vlm_folders, tmp_path, capsys, monkeypatch):  # noqa: F811
    """`hputrain train` on that data: the header's images line says the buckets, their token
    counts and that they add no graph, the share of blank slots, and the two warnings."""
    from hputrain.cli import main

    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")
    path = crowded_data(tmp_path / "data")
    assert main(["train", "--model", str(vlm_folders("qwen2_5_vl")), "--dataset", str(path), "--output-dir",
                 str(tmp_path / "run"), "--block-size", "256", "--no-packing", "--max-steps", "1",
                 "--per-device-train-batch-size", "2", "--disable-tqdm", "--precision", "32",
                 "--validation-split-percentage", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"hputrain: images: 11 pixel buckets \(112x112, ... from 56x224 to 224x56\) of 12 to 16 image "
                     r"tokens, aspect ratios kept within 34% from 1:4 to 4:1; each in an image slot of 16 tokens, "
                     r"so the buckets add no graph, 6 slots a block, 19 images, 77.4% of the slots padding", out), out
    assert re.search(r"\nhputrain: warning: 77% of the image slots are blank images, .* line 13\)", out)
    assert re.search(r"\nhputrain: warning: 1 example has an image whose pixel bucket changes its aspect ratio "
                     r"by more than 10% \(the most: 150%, .* line 14\)", out)
