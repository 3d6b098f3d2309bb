"""Every image-text-to-text model type transformers has is either covered (a family of
kinds/vlm/family.py) or refused in one line that says what it lacks; the covered ones load and
name their family in the run header's kind."""
from __future__ import annotations

import pytest

from hputrain.models import kind
from hputrain.kinds.vlm import family as vision

from ...vlm_fixtures import FAMILIES

transformers = pytest.importorskip("transformers")
mapping = pytest.importorskip("transformers.models.auto.modeling_auto")
TYPES = sorted(getattr(mapping, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {}))


def test_every_covered_family_is_one_transformers_has():
    covered = {t for f in vision.FAMILIES for t in f.model_types}
    assert covered == set(FAMILIES)
    assert covered <= set(TYPES)


@pytest.mark.parametrize("model_type", TYPES)
def test_each_type_is_covered_or_refused_in_one_line(model_type):
    line = vision.refusal(model_type)
    covered = any(model_type in f.model_types for f in vision.FAMILIES)
    assert (line is None) == covered
    if line is not None:
        assert "\n" not in line and line.startswith(f"{model_type} ")
        assert "LLaVA, Gemma 3, Qwen2.5-VL" in line


def test_the_reasons_name_what_is_missing_for_the_types_known_today():
    """A type added to transformers after this list gets the generic line (it still refuses);
    each type is in one group only, and nearly every type today has its reason."""
    named = [t for types in vision.REASONS.values() for t in types]
    assert len(named) == len(set(named))
    generic = [t for t in TYPES if t not in named and vision.refusal(t) is not None]
    assert len(generic) <= len(TYPES) // 10, f"types without a reason: {generic}"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_header_kind_names_the_family(family):
    from ...vlm_fixtures import tiny_vlm_config, vlm_tokenizer

    config = tiny_vlm_config(family, vlm_tokenizer())
    assert vision.is_image_text_to_text(config)
    assert kind.describe(config) == f"image-text-to-text: {vision.vision_family(config).name}"
    assert kind.describe(transformers.LlamaConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1,
                                                  num_attention_heads=1, intermediate_size=8)) == "dense"
    assert vision.image_token_id(config) == config.image_token_id
