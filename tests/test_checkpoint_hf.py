"""A Hugging Face model loaded with from_pretrained checkpoints and resumes: its configuration is
saved as transformers saves it (config.json), not in trainer_state.json, where its dtype
(torch.float32 once loaded) made json.dumps fail at the first checkpoint."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")

from hputrain import Trainer, TrainingArguments  # noqa: E402


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama saved with save_pretrained, as a model folder from the Hub would be."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def load(folder):
    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert model.config.dtype == torch.float32  # what made the old trainer_state.json fail
    return model


def data():
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 12), generator=g)]


def train(model, output_dir, max_steps, resume=None):
    args = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, save_steps=2,
                             logging_steps=1, per_device_train_batch_size=4, disable_tqdm=True,
                             learning_rate=1e-2, lr_scheduler_type="constant",
                             resume_from_checkpoint=resume,
                             throughput_warmup_steps=0, accelerator="cpu")
    return Trainer(model, args, train_dataset=data()).train()  # constant lr: 2 + 2 steps == 4


def test_from_pretrained_llama_checkpoints_and_resumes(tmp_path, pretrained):
    straight = load(pretrained)
    train(straight, tmp_path / "straight", 4)

    stopped = tmp_path / "stopped"
    train(load(pretrained), stopped, 2)
    folder = stopped / "checkpoint-2"
    state = json.loads((folder / "trainer_state.json").read_text())
    assert "model_config" not in state and state["global_step"] == 2
    saved = transformers.AutoConfig.from_pretrained(folder)  # config.json as transformers wrote it
    assert isinstance(saved, transformers.LlamaConfig)
    expected = load(pretrained).config.to_dict()
    assert {**saved.to_dict(), "_name_or_path": None} == {**expected, "_name_or_path": None}

    resumed = load(pretrained)
    train(resumed, stopped, 4, resume="latest")
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_built_in_gpt_config_json_is_its_fields(tmp_path):
    import dataclasses

    from hputrain.checkpoint.saving import save_checkpoint
    from hputrain.models.gpt import GPT, GPTConfig

    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    folder = save_checkpoint(tmp_path, 1, model=GPT(config), optimizer=None, scheduler=None,
                             state={}, accelerator=None)
    assert GPTConfig(**json.loads((folder / "config.json").read_text())) == config
    assert dataclasses.asdict(config) == json.loads((folder / "config.json").read_text())
