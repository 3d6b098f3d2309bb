"""A tiny Hugging Face model folder as a user would have on disk: a Llama written with
`save_pretrained` and a byte-level BPE tokenizer trained with `tokenizers` in the test, so that
nothing is downloaded. Shared by the fine-tuning, export and kernel tests."""
from __future__ import annotations

from pathlib import Path

import pytest


def _transformers_major() -> int:
    try:
        import transformers
    except ImportError:
        return 0
    return int(transformers.__version__.split(".")[0])


lazy_rehearses_hf_models = pytest.mark.skipif(
    _transformers_major() < 5, reason="transformers before 5.0 opens torch.autocast on the lazy "
    "device in its rotary embeddings, which torch does not support (a one-line error: "
    "test_execution.py)")
"""On a Llama in lazy mode on the CPU: needs transformers >= 5.0 (`make test-oldest` has 4.x)."""

SAMPLE_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine and a penny saved is a penny earned",
    "def add(a, b):\n    return a + b\n",
    "to be or not to be, that is the question",
]


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer (every byte has a token, so any text encodes) with the
    special tokens a causal LM recipe expects."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLE_TEXT * 20, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")


def tiny_llama_config(vocab_size: int, **overrides):
    transformers = pytest.importorskip("transformers")
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    return transformers.LlamaConfig(**(fields | overrides))


def tiny_llama_folder(folder: Path, seed: int = 0, **config_overrides) -> Path:
    """`folder` holding config.json, generation_config.json, model.safetensors and the tokenizer
    files, as `save_pretrained` writes them."""
    import torch
    transformers = pytest.importorskip("transformers")

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config(len(tokenizer), **config_overrides))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def write_text_file(path: Path, lines: int = 200) -> Path:
    """A plain-text data set: the sample sentences, repeated with a line number."""
    path.write_text("".join(f"{i} {SAMPLE_TEXT[i % len(SAMPLE_TEXT)]}\n" for i in range(lines)))
    return path


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory) -> Path:
    """One tiny Llama folder for the whole session (read-only: copy it to change it)."""
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-llama"))


def llama_config_folder(folder: Path, vocab_size: int = 4096, hidden_size: int = 256,
                        intermediate_size: int = 704, layers: int = 4, heads: int = 8) -> Path:
    """A Llama folder with config.json alone: all `hputrain plan` reads (a measured run draws
    random weights)."""
    import transformers

    transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                             intermediate_size=intermediate_size, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads // 2,
                             max_position_embeddings=512).save_pretrained(folder)
    return folder


@pytest.fixture
def on_cpu(monkeypatch):
    """hputrain picks the CPU in this test, whatever the machine has (the plan tests measure on it)."""
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module", name="llama")
def llama_config(tmp_path_factory) -> Path:
    """A folder with config.json alone (llama_config_folder): all the plan reads; a measured run
    draws the weights."""
    folder = llama_config_folder(tmp_path_factory.mktemp("llama-config"))
    assert not list(folder.glob("*.safetensors"))
    return folder
