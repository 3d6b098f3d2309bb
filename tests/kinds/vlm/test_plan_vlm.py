"""Issue 41 item 6: `hputrain plan` on image-text-to-text models. The references: the same
training step measured in a real run of hputrain's Trainer on the run's image blocks (StepPeak on
the real tensors, the blocks stacked by the run's ImageCollator), the model transformers builds
from the folder, and the folder's processor's image-token expansion."""
from __future__ import annotations

import json
import shutil

import pytest

from hputrain.cli import main

from ...hf_fixtures import on_cpu  # noqa: F401  (fixture)
from ...plan_step_script import measured, planned
from ...vlm_fixtures import image_data, image_processor, vlm_folders  # noqa: F401  (fixtures)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("on_cpu")


def flags(folder, *more: str) -> list[str]:
    return ["--model", str(folder), "--block-size", "128", "--per-device-train-batch-size", "2",
            "--precision", "fp32", *more]


def check_against_measured(folder, *more: str):
    plan, real = planned(flags(folder, *more)), measured(flags(folder, *more))
    assert plan.peak_bytes == pytest.approx(real.peak_bytes, rel=0.10), (plan.breakdown,
                                                                         real.breakdown)
    # every weight once (tied embeddings tied), and AdamW's moments of exactly the trained ones
    assert plan.breakdown["parameters"] == pytest.approx(real.breakdown["parameters"], rel=0.01)
    assert plan.breakdown["optimizer"] == pytest.approx(real.breakdown["optimizer"], rel=0.01)
    return plan, real


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_the_plan_of_a_tiny_vlm_is_within_10_percent_of_the_measured_step(family, vlm_folders):
    """Full fine-tuning, the tower frozen and the projector trained (the recipe's default):
    the vision tower on the blocks' image slots, the image tokens in the language model."""
    plan, real = check_against_measured(vlm_folders(family))
    assert plan.breakdown["activations"] == pytest.approx(real.breakdown["activations"], rel=0.10) \
        or family == "qwen2_5_vl"  # its tower's temporaries are sorted otherwise on fake tensors


@pytest.mark.slow
@pytest.mark.parametrize("family, more", [
    ("gemma3", ()), ("llava", ("--lora-r", "8")),
    ("qwen2_5_vl", ("--lora-r", "8", "--train-vision-tower"))])
def test_the_plan_with_lora_tied_embeddings_or_a_trained_tower_is_within_10_percent(family, more,
                                                                                    vlm_folders):
    check_against_measured(vlm_folders(family), *more)


def _tower_parameters(folder, family: str) -> int:
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    tower = model.model.visual if family == "qwen2_5_vl" else model.model.vision_tower
    return sum(p.numel() for name, p in tower.named_parameters() if not name.startswith("merger."))


def _processor_tokens(folder, family: str) -> int:
    """Image tokens the folder's processing gives one image of its first bucket: the processor's
    expansion (LLaVA), or Qwen's image processor's grid (t*h*w / merge^2) for that size."""
    from PIL import Image

    if family == "qwen2_5_vl":
        grid = image_processor(family)(images=[Image.new("RGB", (112, 112))],
                                       return_tensors="pt")["image_grid_thw"][0]
        return int(grid.prod()) // 4
    processor = transformers.AutoProcessor.from_pretrained(folder)
    out = processor(text=["<image>"], images=[Image.new("RGB", (28, 28))], return_tensors="pt")
    return int((out["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<image>")).sum())


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_the_plan_names_the_towers_share_and_the_image_tokens(family, vlm_folders, capsys):
    folder = vlm_folders(family)
    assert main(["plan", "--json", *flags(folder, "--image-slots", "3")]) == 0
    vision = json.loads(capsys.readouterr().out)["vision"]
    tokens = _processor_tokens(folder, family)
    assert vision["tokens_per_image"] == tokens
    assert vision["images"] == 2 * 3 and vision["image_tokens"] == 2 * 3 * tokens
    assert vision["tower_parameters"] == _tower_parameters(folder, family)
    assert not vision["tower_trained"]
    assert vision["tower_bytes"] == vision["tower_parameters"] * 4  # frozen fp32 weights alone
    assert main(["plan", "--json",
                 *flags(folder, "--image-slots", "3", "--train-vision-tower")]) == 0
    trained = json.loads(capsys.readouterr().out)["vision"]
    # weights, gradients and two AdamW moments; and what its forward keeps for backward (frozen:
    # nothing, or for Qwen only its trained merger's inputs, the projector inside its tower)
    assert trained["tower_trained"] and trained["tower_bytes"] == vision["tower_parameters"] * 16
    assert trained["tower_activation_bytes"] > 4 * max(1, vision["tower_activation_bytes"])
    assert main(["plan", *flags(folder)]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert header.startswith("  vision: ") and "frozen" in header and "image slots" not in header


def test_a_folder_of_config_json_alone_plans_the_configs_image_tokens(vlm_folders, tmp_path,
                                                                      capsys):
    """No processor in the folder: LLaVA's tokens per image from its config (image_seq_length),
    which is what its processor expands an image into."""
    folder = vlm_folders("llava")
    only = tmp_path / "config-only"
    only.mkdir()
    shutil.copy(folder / "config.json", only / "config.json")
    assert main(["plan", "--json", *flags(only)]) == 0
    vision = json.loads(capsys.readouterr().out)["vision"]
    assert vision["tokens_per_image"] == _processor_tokens(folder, "llava")


@pytest.mark.parametrize("case", ["slots", "buckets", "method"])
def test_image_settings_the_run_refuses_are_one_line(case, vlm_folders, capsys):
    folder = vlm_folders("llava")
    more = {"slots": ["--block-size", "16", "--image-slots", "8"],
            "buckets": ["--image-buckets", "56x56"], "method": ["--method", "dpo"]}[case]
    capsys.readouterr()  # what making the folder printed
    assert main(["plan", *flags(folder), *more]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    flag = {"slots": "--image-slots", "buckets": "--image-buckets", "method": "--method dpo"}[case]
    assert len(err) == 1 and flag in err[0], err


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_the_planned_batch_has_the_shapes_of_the_runs_batch(family, vlm_folders, image_data):
    """The plan's blocks against the run's own: the image data set encoded and packed by
    kinds/vlm/data/ (the recipe's load_image_rows) and stacked by its ImageCollator, at the same
    --block-size and --image-slots: every key, shape and dtype."""
    from hputrain.cli import build_parser
    from hputrain.kinds.vlm.data.encode import Processing
    from hputrain.recipes import chosen_recipe
    from hputrain.kinds.vlm.run import load_image_rows

    from ...plan_step_script import settings

    folder = vlm_folders(family)
    asked = flags(folder, "--image-slots", "3", "--dataset", str(image_data("messages")))
    step, _ = settings(asked)
    parsed = vars(build_parser().parse_args(["train", *asked]))
    _, options, _ = chosen_recipe(parsed)
    data = load_image_rows(options, Processing.load(folder), 128, None)
    real = data.collator([data.train[0], data.train[1]])
    planned_batch = step.batch(2)
    assert set(planned_batch) == set(real)
    for key, value in real.items():
        found = planned_batch[key]
        assert (found.shape, found.dtype) == (value.shape, value.dtype), key
