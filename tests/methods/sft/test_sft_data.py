"""SFT data (issue 24): row shapes, assistant and completion masks checked against transformers'
own assistant mask on five published chat template families, packing by best-fit decreasing, and
the block-diagonal mask checked against per-example forwards of a tiny Llama."""
from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from hputrain.data import packing
from hputrain.data import sft
from hputrain.data.chat import ChatTemplate
from hputrain.errors import InputError
from tests.hf_fixtures import tiny_llama_config, tiny_tokenizer

transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).parents[2] / "chat_templates"

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>",
           "<end_of_turn>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]

# family: (bos, eos, the end-of-turn marker, the text after it that is not learned)
FAMILIES = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>", ""),
    "chatml": ("<s>", "<|im_end|>", "<|im_end|>", "\n"),
    "mistral": ("<s>", "</s>", "</s>", ""),
    "gemma": ("<bos>", "<eos>", "<end_of_turn>", "\n"),
    "phi3": ("<s>", "<|endoftext|>", "<|end|>", "\n"),
}

TWO_TURNS = [
    {"role": "user", "content": "what does the quick brown fox do?"},
    {"role": "assistant", "content": "the quick brown fox jumps over the lazy dog."},
    {"role": "user", "content": "and a penny saved?"},
    {"role": "assistant", "content": "a penny saved is a penny earned, caf\u00e9 \u2615"},
]
EDGES = [  # an empty answer, and text around the content that some templates trim
    {"role": "user", "content": "  to be or not to be  "},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "    return a + b\n"},
]
WITH_SYSTEM = [{"role": "system", "content": "a stitch in time saves nine"}] + TWO_TURNS
CONVERSATIONS = {"two_turns": TWO_TURNS, "edges": EDGES, "with_system": WITH_SYSTEM}
NO_SYSTEM = {"gemma", "mistral"}  # gemma refuses a system message; mistral's moves (see below)


@pytest.fixture(scope="module")
def base_tokenizer():
    tokenizer = tiny_tokenizer(vocab_size=420)  # merges whole words of the sample text
    tokenizer.add_tokens(SPECIAL, special_tokens=True)
    return tokenizer


def family_tokenizer(base, family: str, variant: str = ""):
    """The tiny tokenizer dressed as `family`: its template (`variant`: "_tagged", ...), bos, eos."""
    tokenizer = copy.deepcopy(base)
    bos, eos, _, _ = FAMILIES[family]
    tokenizer.bos_token, tokenizer.eos_token = bos, eos
    tokenizer.chat_template = (TEMPLATES / f"{family}{variant}.jinja").read_text()
    tokenizer.name_or_path = f"{family}{variant}"
    return tokenizer


def transformers_mask(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def runs(mask):
    """[start, end) of each run of True."""
    found, start = [], None
    for k, m in enumerate(mask + [False]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            found.append((start, k))
            start = None
    return found


def conversation_cases():
    for family in FAMILIES:
        for name, messages in CONVERSATIONS.items():
            if not (name == "with_system" and family in NO_SYSTEM):
                yield pytest.param(family, messages, id=f"{family}-{name}")


# -- assistant masks -------------------------------------------------------------------------------

@pytest.mark.parametrize("family,messages", list(conversation_cases()))
def test_masks_equal_transformers_assistant_mask_with_and_without_tags(base_tokenizer, family, messages):
    """On the tagged copy (tags around the content and the end marker) the mask is transformers'
    return_assistant_tokens_mask exactly; the published template without tags, cut by rendering,
    gives the same tokens and the same mask."""
    tagged = family_tokenizer(base_tokenizer, family, "_tagged")
    plain = family_tokenizer(base_tokenizer, family)
    assert (tagged.apply_chat_template(messages, tokenize=False)
            == plain.apply_chat_template(messages, tokenize=False))
    ids, expected = transformers_mask(tagged, messages)
    assert len(runs(expected)) == sum(m["role"] == "assistant" for m in messages)

    template = ChatTemplate(tagged)
    assert template.tagged
    learned = list(range(len(messages)))
    assert template.assistant_mask(messages, learned, "row 0") == (ids, expected)

    template = ChatTemplate(plain)
    assert not template.tagged
    assert template.assistant_mask(messages, learned, "row 0") == (ids, expected)


@pytest.mark.parametrize("family,messages", list(conversation_cases()))
def test_each_turn_learns_its_content_and_end_marker_only(base_tokenizer, family, messages):
    """Decoded, each learned run is the assistant's text and the end-of-turn marker; the newline
    after the marker and Phi-3's closing <|endoftext|> stay unlearned."""
    tokenizer = family_tokenizer(base_tokenizer, family)
    _, _, marker, after = FAMILIES[family]
    ids, mask = ChatTemplate(tokenizer).assistant_mask(messages, list(range(len(messages))), "row 0")
    texts = [tokenizer.decode(ids[a:b]) for a, b in runs(mask)]
    trims = family in ("llama3", "gemma")  # their templates trim the content
    lead = " " if family == "mistral" else ""
    expected = [lead + (m["content"].strip() if trims else m["content"]) + marker
                for m in messages if m["role"] == "assistant"]
    assert len(texts) == len(expected)
    for text, want in zip(texts, expected):
        # A token may start in the header's newline and run into the answer's own leading spaces
        # ('\n   ' before ' return'): learned whole, as transformers' mask learns it.
        assert text == want or (text.endswith(want) and not text[:-len(want)].strip())
    marker_id = tokenizer.convert_tokens_to_ids(marker)
    for _, end in runs(mask):
        assert ids[end - 1] == marker_id
        assert tokenizer.decode(ids[end:]).startswith(after)
    if family == "phi3":  # the template's closing text ends the conversation, unlearned
        assert ids[-1] == tokenizer.eos_token_id and not mask[-1]


@pytest.mark.parametrize("variant", ["", "_tagged"], ids=["untagged", "tagged"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_end_of_turn_is_the_marker_generation_stops_at(base_tokenizer, family, variant):
    """`hputrain generate --chat` stops at this text: each family's own end-of-turn marker (not
    the newline after it, nor Phi-3's closing <|endoftext|>)."""
    marker = FAMILIES[family][2]
    assert ChatTemplate(family_tokenizer(base_tokenizer, family, variant)).end_of_turn() == marker


def test_tags_around_the_content_alone_get_the_end_marker_added(base_tokenizer):
    """transformers' mask covers what the tags enclose; with ChatML tagged around the content
    only, it stops before <|im_end|>. hputrain's mask is every token of each answer's characters
    plus the end marker, and the same as the untagged template's.

    The last answer ends in U+2615, three byte-level tokens of one character. transformers before
    5.24 marked only the first of them (char_to_token of the last character); 5.24 marks all
    three. The mask here is built from the rendered text's offsets alone, so it holds for both."""
    tagged = family_tokenizer(base_tokenizer, "chatml", "_tagged_content_only")
    ids, theirs = transformers_mask(tagged, TWO_TURNS)
    got_ids, ours = ChatTemplate(tagged).assistant_mask(TWO_TURNS, [0, 1, 2, 3], "row 0")
    assert got_ids == ids
    assert all(ours[k] for k in range(len(ids)) if theirs[k])  # never less than transformers'
    text = tagged.apply_chat_template(TWO_TURNS, tokenize=False)
    offsets = tagged(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == len(ids)
    im_end = tagged.convert_tokens_to_ids("<|im_end|>")
    expected, searched_from = [False] * len(ids), 0
    for answer in (m["content"] for m in TWO_TURNS if m["role"] == "assistant"):
        start = text.index(answer, searched_from)
        end = searched_from = start + len(answer)
        inside = [k for k, (a, b) in enumerate(offsets) if a < end and b > start]
        marker = inside[-1] + 1  # the end of turn right after the answer
        assert ids[marker] == im_end
        for k in [*inside, marker]:
            expected[k] = True
    assert ours == expected
    # the case covers what it is about: the answer's last character spans three tokens (U+2615),
    # the last two of which share its offsets, and the mask runs through them to the end marker
    last_marker = runs(ours)[-1][1] - 1
    assert offsets[last_marker - 1] == offsets[last_marker - 2] == offsets[last_marker - 3]
    plain = family_tokenizer(base_tokenizer, "chatml")
    assert ChatTemplate(plain).assistant_mask(TWO_TURNS, [0, 1, 2, 3], "row 0") == (ids, ours)


def test_a_template_whose_renderings_are_not_prefixes_is_one_error_naming_it(base_tokenizer):
    """Mistral v0.3 writes the system prompt into the last user message, so the conversation up
    to the first answer renders differently from the whole: no turn can be cut from it."""
    tokenizer = family_tokenizer(base_tokenizer, "mistral")
    with pytest.raises(InputError) as caught:
        sft.encode_rows([{"messages": WITH_SYSTEM}], tokenizer, template_name="mistral-v0.3")
    message = str(caught.value)
    assert "row 0" in message and "mistral-v0.3" in message and "prefixes" in message
    assert "\n" not in message


def test_messages_and_sharegpt_rows_give_the_same_examples(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "chatml")
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": names[m["role"]], "value": m["content"]} for m in WITH_SYSTEM]
    a, stats_a = sft.encode_rows([{"messages": WITH_SYSTEM}], tokenizer)
    b, stats_b = sft.encode_rows([{"conversations": sharegpt, "id": 7}], tokenizer)
    assert a == b and stats_a == stats_b == sft.SFTStats(rows=1, examples=1)


def test_labels_are_the_mask_with_the_first_token_never_learned(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "llama3")
    (example,), _ = sft.encode_rows([{"messages": TWO_TURNS}], tokenizer)
    ids, mask = ChatTemplate(tokenizer).assistant_mask(TWO_TURNS, [0, 1, 2, 3], "row 0")
    assert example["input_ids"] == ids
    assert example["labels"] == [t if m else -100 for t, m in zip(ids, mask)]
    (every,), _ = sft.encode_rows([{"messages": TWO_TURNS}], tokenizer, assistant_only_loss=False)
    assert every["input_ids"] == ids and every["labels"] == [-100] + ids[1:]


def test_a_datasets_table_with_keys_filled_by_none(base_tokenizer):
    """A datasets.Dataset gives every message every key any message has, None where absent."""
    datasets = pytest.importorskip("datasets")
    tokenizer = family_tokenizer(base_tokenizer, "chatml")
    named = [dict(TWO_TURNS[0], name="ann")] + TWO_TURNS[1:]
    table = datasets.Dataset.from_list([{"messages": TWO_TURNS, "id": 0}, {"messages": named, "id": 1}])
    assert table[0]["messages"][0]["name"] is None
    examples, stats = sft.encode_rows(table, tokenizer)
    plain, _ = sft.encode_rows([{"messages": TWO_TURNS}], tokenizer)
    assert stats.examples == 2 and examples[0] == examples[1] == plain[0]


def test_rows_with_nothing_to_learn_are_skipped_and_counted(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "chatml")
    rows = [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:1]}, {"messages": WITH_SYSTEM[:2]}]
    examples, stats = sft.encode_rows(rows, tokenizer)
    assert len(examples) == 1 and stats == sft.SFTStats(rows=3, examples=1, nothing_to_learn=2)


# -- prompt + completion ---------------------------------------------------------------------------

def test_prompt_completion_text_learns_the_completion_and_eos_only(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "mistral")
    prompt, completion = "the quick brown fox", " jumps over the lazy dog"
    (example,), _ = sft.encode_rows([{"prompt": prompt, "completion": completion}], tokenizer)
    ids, labels = example["input_ids"], example["labels"]
    learned = [k for k, label in enumerate(labels) if label != -100]
    assert ids[-1] == tokenizer.eos_token_id and learned[-1] == len(ids) - 1
    assert learned == list(range(learned[0], len(ids)))  # one run, up to the eos
    assert tokenizer.decode(ids[:learned[0]]) == prompt
    assert tokenizer.decode(ids[learned[0]:]) == completion + "</s>"
    assert all(labels[k] == ids[k] for k in learned)

    (every,), _ = sft.encode_rows([{"prompt": prompt, "completion": completion}], tokenizer,
                                  completion_only_loss=False)
    assert every["labels"] == [-100] + every["input_ids"][1:]


def test_a_token_across_the_prompt_end_is_learned(base_tokenizer):
    """A word cut between prompt and completion is one token: the completion needs it."""
    tokenizer = family_tokenizer(base_tokenizer, "mistral")
    example = sft.encode_prompt_completion(tokenizer, "the qu", "ick brown fox")
    encoded = tokenizer("the quick brown fox", return_offsets_mapping=True)
    across = [k for k, (s, e) in enumerate(encoded["offset_mapping"]) if s < 6 < e]
    assert across, "the sample text's tokenizer should merge 'quick'"
    assert example["labels"][across[0]] != -100 and example["labels"][across[0] - 1] == -100


@pytest.mark.parametrize("family", ["chatml", "phi3", "llama3"])
def test_conversational_prompt_completion_learns_the_completion_turns(base_tokenizer, family):
    """A few-shot prompt's assistant turn is not learned; the completion's turn is, as in the
    same conversation given as messages."""
    tokenizer = family_tokenizer(base_tokenizer, family)
    row = {"prompt": TWO_TURNS[:3], "completion": TWO_TURNS[3:]}
    (example,), _ = sft.encode_rows([row], tokenizer)
    ids, mask = ChatTemplate(tokenizer).assistant_mask(TWO_TURNS, [3], "row 0")
    assert example["input_ids"] == ids and sum(mask) > 0
    assert example["labels"] == [t if m else -100 for t, m in zip(ids, mask)]


# -- bad rows --------------------------------------------------------------------------------------

BAD_ROWS = [
    ({"messages": None}, "no messages"),
    ({"messages": []}, "empty"),
    ({"messages": "hello"}, "not a list"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "role 'bot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "no text"),
    ({"messages": ["hi"]}, "not a"),
    ({"conversations": [{"from": "robot", "value": "hi"}]}, "from 'robot'"),
    ({"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]}, "both be text"),
]


@pytest.mark.parametrize("row,words", BAD_ROWS)
def test_a_bad_row_is_one_line_naming_it(base_tokenizer, row, words):
    tokenizer = family_tokenizer(base_tokenizer, "chatml")
    good = {key: TWO_TURNS if key in ("messages", "conversations") else "x" for key in row}
    if "conversations" in row:
        good["conversations"] = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    with pytest.raises(InputError) as caught:
        sft.encode_rows([good, row], tokenizer)
    message = str(caught.value)
    assert message.startswith("row 1: ") and words in message and "\n" not in message


def test_a_template_refusing_a_row_is_one_line_naming_row_and_template(base_tokenizer):
    tokenizer = family_tokenizer(base_tokenizer, "gemma")
    with pytest.raises(InputError, match=r"^row 0: the chat template gemma refuses .*System role"):
        sft.encode_rows([{"messages": WITH_SYSTEM}], tokenizer)


def test_format_comes_from_the_columns(base_tokenizer):
    assert sft.detect_format(["id", "messages", "text"]) == "messages"
    assert sft.detect_format(["conversations"]) == "conversations"
    assert sft.detect_format(["completion", "prompt"]) == "prompt_completion"
    with pytest.raises(InputError, match="'text', 'label'"):
        sft.detect_format(["text", "label"])
    tokenizer = family_tokenizer(base_tokenizer, "chatml")
    tokenizer.chat_template = None
    with pytest.raises(InputError, match="no chat template"):
        sft.encode_rows([{"messages": TWO_TURNS}], tokenizer)


# -- packing ---------------------------------------------------------------------------------------

def first_fit_in_order(lengths, capacity):
    bins, room = [], []
    for i, n in enumerate(lengths):
        b = next((b for b, r in enumerate(room) if r >= n), None)
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= n
    return bins


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_decreasing_uses_no_more_blocks_than_first_fit_and_never_overflows(seed):
    rng = random.Random(seed)
    capacity = rng.choice([64, 100, 512])
    shape = seed % 3  # many short rows, uniform lengths, a few long with many short
    lengths = [min(capacity, max(1, int(rng.expovariate(1 / (capacity / 6)))) if shape == 0 else
               rng.randint(1, capacity) if shape == 1 else
               rng.choice([rng.randint(capacity // 2, capacity), rng.randint(1, capacity // 8)]))
               for _ in range(400)]
    bins = packing.best_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert len(bins) <= len(first_fit_in_order(lengths, capacity))
    assert len(bins) >= -(-sum(lengths) // capacity)


def test_best_fit_decreasing_puts_each_item_where_it_fits_best():
    # 6 first opens a bin (room 4), 5 opens another (room 5); 4 best fits the room of 4, 3 the 5.
    assert packing.best_fit_decreasing([3, 5, 6, 4, 2], 10) == [[2, 3], [1, 0, 4]]
    # First fit in this order needs three blocks ([4, 4], [6], [6]); two suffice ([6, 4] twice).
    assert len(first_fit_in_order([4, 4, 6, 6], 10)) == 3
    assert packing.best_fit_decreasing([4, 4, 6, 6], 10) == [[2, 0], [3, 1]]
    # Not a theorem, though: here an order happens to suit first fit ([4, 3, 3], [3, 3, 4], [9])
    # and decreasing order does not (9 | 4 4 | 3 3 3 | 3), hence the seeded data sets above.
    lengths = [4, 3, 3, 3, 3, 9, 4]
    assert len(first_fit_in_order(lengths, 10)) == 3
    assert packing.best_fit_decreasing(lengths, 10) == [[5], [0, 6], [1, 2, 3], [4]]


def example(n, learned_from=0, offset=0):
    ids = [offset + k for k in range(n)]
    return {"input_ids": ids, "labels": [t if k >= learned_from else -100 for k, t in enumerate(ids)]}


def test_pack_makes_static_blocks_with_restarting_positions_and_lengths():
    examples = [example(5, 2, 100), example(9, 0, 200), example(2, 1, 300), example(13, 10, 400)]
    blocks, stats = packing.pack(examples, 16, pad_token_id=7)
    # 13 opens a block (room 3), 9 a second (room 7), 5 joins it (room 2), 2 fills it.
    assert [b["seq_lens"][:3].tolist() for b in blocks] == [[13, 0, 0], [9, 5, 2]]
    assert stats.blocks == len(blocks) == 2 and stats.examples == 4 and stats.truncated == 0
    assert stats.tokens == 29 and stats.padding == 3 and stats.padding_fraction == 3 / 32
    seen = []
    for block in blocks:
        assert {k: tuple(v.shape) for k, v in block.items()} == {
            "input_ids": (16,), "labels": (16,), "position_ids": (16,), "seq_lens": (16,)}
        lengths = [n for n in block["seq_lens"].tolist() if n]
        at = 0
        for n in lengths:
            original = next(e for e in examples if e["input_ids"][0] == block["input_ids"][at])
            assert block["input_ids"][at:at + n].tolist() == original["input_ids"]
            assert block["labels"][at:at + n].tolist() == [-100] + original["labels"][1:]
            assert block["position_ids"][at:at + n].tolist() == list(range(n))
            seen.append(original["input_ids"][0])
            at += n
        assert block["input_ids"][at:].tolist() == [7] * (16 - at)
        assert block["labels"][at:].tolist() == [-100] * (16 - at)
        assert block["position_ids"][at:].tolist() == list(range(16 - at))
    assert sorted(seen) == [100, 200, 300, 400]


def test_pack_truncates_long_examples_and_drops_those_left_with_nothing_to_learn():
    examples = [example(20, 0, 0), example(20, 12, 100), example(4, 0, 200)]
    blocks, stats = packing.pack(examples, 10)
    assert (stats.truncated, stats.nothing_to_learn, stats.examples) == (2, 1, 2)
    first = blocks[0]
    assert first["input_ids"][:10].tolist() == list(range(10)) and first["seq_lens"][0] == 10
    assert all(len(b["input_ids"]) == 10 for b in blocks)


def test_unpacked_rows_pad_to_length_buckets():
    rows, collate, stats = packing.unpacked([example(5), example(30), example(70)], 64, pad_token_id=3,
                                            buckets=4)
    assert stats.truncated == 1 and len(rows) == 3
    batch = collate(rows[:2])
    assert batch["input_ids"].shape == (2, 32)
    assert batch["input_ids"][0, 5:].eq(3).all() and batch["labels"][0, 5:].eq(-100).all()
    assert collate(rows)["input_ids"].shape == (3, 64)


def test_block_causal_mask_by_hand():
    allowed = packing.block_causal_mask(torch.tensor([3, 2, 0, 0, 0, 0]))
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0],
                             [0, 0, 0, 1, 1, 0],
                             [0, 0, 0, 0, 0, 1]], dtype=torch.bool)  # the padding token sees itself
    assert allowed.shape == (1, 1, 6, 6) and torch.equal(allowed[0, 0], expected)
    additive = packing.block_causal_mask(torch.tensor([[3, 2], [6, 0]]), block_size=6, dtype=torch.float32)
    assert additive.shape == (2, 1, 6, 6) and additive.dtype == torch.float32
    assert torch.equal(additive[0, 0] == 0, expected)
    assert torch.equal(additive[1, 0] == 0, torch.ones(6, 6, dtype=torch.bool).tril())
    assert additive.min() == torch.finfo(torch.float32).min


# -- a packed forward equals the unpacked ones ----------------------------------------------------

@pytest.fixture(scope="module", params=["sdpa", "eager"])
def llama(request):
    torch.manual_seed(0)
    config = tiny_llama_config(64, attn_implementation=request.param, attention_dropout=0.0)
    model = transformers.LlamaForCausalLM(config)
    model.train()  # training mode, as the trainer runs it; dropout is 0
    assert model.config.use_cache  # left at the model's default
    return model


@pytest.fixture(scope="module")
def packed_block():
    gen = torch.Generator().manual_seed(1)
    examples = [example(n) for n in (7, 5, 3)]
    for e in examples:
        e["input_ids"] = torch.randint(4, 64, (len(e["input_ids"]),), generator=gen).tolist()
        e["labels"] = list(e["input_ids"])
    blocks, _ = packing.pack(examples, 16, pad_token_id=3)
    assert len(blocks) == 1 and blocks[0]["seq_lens"][:4].tolist() == [7, 5, 3, 0]
    return examples, {k: v[None] for k, v in blocks[0].items()}


def per_example_logits(model, block):
    out, at = [], 0
    for n in [n for n in block["seq_lens"][0].tolist() if n]:
        out.append(model(input_ids=block["input_ids"][:, at:at + n]).logits[0])
        at += n
    return out


def split(logits, block):
    lengths = [n for n in block["seq_lens"][0].tolist() if n]
    return list(torch.split(logits[0, :sum(lengths)], lengths))


def test_packed_logits_with_the_block_mask_equal_the_unpacked_ones(llama, packed_block):
    _, block = packed_block
    mask = packing.block_causal_mask(block["seq_lens"], dtype=torch.float32)
    with torch.no_grad():
        expected = per_example_logits(llama, block)
        packed = llama(input_ids=block["input_ids"], position_ids=block["position_ids"],
                       attention_mask=mask).logits  # use_cache left at its default, True
        without_mask = llama(input_ids=block["input_ids"], position_ids=block["position_ids"]).logits
        no_cache = llama(input_ids=block["input_ids"], position_ids=block["position_ids"],
                         use_cache=False).logits
    for got, want in zip(split(packed, block), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Without the mask, the default cache turns off transformers' detection of packed rows from
    # the restarting positions: the later examples attend to the earlier ones.
    first, *later = split(without_mask, block)
    torch.testing.assert_close(first, expected[0], atol=1e-5, rtol=0)
    assert all((got - want).abs().max() > 1e-3 for got, want in zip(later, expected[1:]))
    # With use_cache=False and no mask, transformers finds the examples from position_ids itself.
    for got, want in zip(split(no_cache, block), expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_boolean_block_mask_serves_sdpa_but_not_eager(llama, packed_block):
    """sdpa takes True as 'may attend'; eager adds the mask to the scores, so a boolean mask there
    adds 0 or 1 and masks nothing: eager needs the additive (float) mask."""
    _, block = packed_block
    allowed = packing.block_causal_mask(block["seq_lens"])
    with torch.no_grad():
        expected = per_example_logits(llama, block)
        packed = llama(input_ids=block["input_ids"], position_ids=block["position_ids"],
                       attention_mask=allowed).logits
    close = [torch.allclose(got, want, atol=1e-5, rtol=0)
             for got, want in zip(split(packed, block), expected)]
    assert close == ([True] * 3 if llama.config._attn_implementation == "sdpa" else [False] * 3)


def test_packed_loss_equals_the_sum_of_the_example_losses(llama, packed_block):
    examples, block = packed_block
    mask = packing.block_causal_mask(block["seq_lens"], dtype=torch.float32)
    with torch.no_grad():
        packed = llama(input_ids=block["input_ids"], position_ids=block["position_ids"],
                       attention_mask=mask, labels=block["labels"]).loss
        counted = int((block["labels"][:, 1:] != -100).sum())
        total = 0.0
        for e in examples:
            ids = torch.tensor([e["input_ids"]])
            total += llama(input_ids=ids, labels=ids).loss * (len(e["input_ids"]) - 1)
    torch.testing.assert_close(packed * counted, total, atol=1e-4, rtol=1e-6)


def test_no_gradient_crosses_examples_in_a_block(llama, packed_block):
    """The loss of the second example has a gradient of exactly 0 with respect to the first
    example's input embeddings; without the block mask it does not."""
    _, block = packed_block
    embeddings = llama.get_input_embeddings()(block["input_ids"]).detach()
    labels = torch.full_like(block["labels"], -100)
    labels[:, 8:12] = block["input_ids"][:, 8:12]  # the second example occupies tokens 7..11

    def first_example_grad(**extra):
        inputs = embeddings.clone().requires_grad_(True)
        loss = llama(inputs_embeds=inputs, position_ids=block["position_ids"], labels=labels,
                     **extra).loss
        (grad,) = torch.autograd.grad(loss, inputs)
        return grad

    mask = packing.block_causal_mask(block["seq_lens"], dtype=torch.float32)
    grad = first_example_grad(attention_mask=mask)
    assert torch.count_nonzero(grad[:, :7]) == 0 and torch.count_nonzero(grad[:, 12:]) == 0
    assert torch.count_nonzero(grad[:, 7:12]) > 0
    assert torch.count_nonzero(first_example_grad()[:, :7]) > 0
