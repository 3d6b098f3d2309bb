"""A Hugging Face model loaded with from_pretrained checkpoints and resumes: its configuration is
saved as transformers saves it (config.json), not in trainer_state.json, where its dtype
(torch.float32 once loaded) made json.dumps fail at the first checkpoint."""
import json
import warnings

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


# -- a model folder whose safetensors file was cut short (issue 46 item 7) ----------------------------

@pytest.fixture(scope="module")
def cut_folders(tmp_path_factory):
    """Model folders as a copy or a download cut short leaves them: one whose model.safetensors
    ends halfway, one in shards (model-0000K-of-00002.safetensors and the index) whose first
    shard does, and LoRA adapter folders whose adapter file, or whose base's weights, do.
    {kind: (folder, the file cut)}."""
    import shutil

    from ..hf_fixtures import tiny_llama_folder

    root = tmp_path_factory.mktemp("cut")
    whole = tiny_llama_folder(root / "whole")
    model = transformers.AutoModelForCausalLM.from_pretrained(whole)
    sharded = root / "sharded"
    model.save_pretrained(sharded, max_shard_size=100_000)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(whole / name, sharded / name)
    peft = pytest.importorskip("peft")
    adapter = root / "adapter"
    with warnings.catch_warnings():  # PEFT reads a name transformers 5 deprecates
        warnings.simplefilter("ignore", FutureWarning)
        peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    on_cut_base = shutil.copytree(adapter, root / "adapter-on-cut-base")
    cut_base = shutil.copytree(whole, root / "cut-base")
    config = json.loads((on_cut_base / "adapter_config.json").read_text())
    (on_cut_base / "adapter_config.json").write_text(json.dumps(
        {**config, "base_model_name_or_path": str(cut_base)}))
    single = shutil.copytree(whole, root / "single")
    cases = {"single": (single, single / "model.safetensors"),
             "sharded": (sharded, sharded / "model-00001-of-00002.safetensors"),
             "adapter": (adapter, adapter / "adapter_model.safetensors"),
             "base": (on_cut_base, cut_base / "model.safetensors")}
    assert json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    for _, file in cases.values():
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    return cases


@pytest.mark.parametrize("kind, command", [
    ("single", "train"), ("sharded", "train"), ("single", "train --devices 2"),
    ("sharded", "train --strategy fsdp --devices 2"), ("single", "evaluate"),
    ("sharded", "generate"), ("adapter", "generate"), ("base", "train"), ("adapter", "evaluate")])
def test_a_cut_safetensors_file_is_one_line_naming_it(cut_folders, kind, command, tmp_path,
                                                     cli_here):
    """`hputrain train / evaluate / generate --model DIR` on a folder whose safetensors file was
    cut short: one line naming the file, exit 2, before any process starts (it was
    safetensors' 29-line traceback, exit 1, and 84 lines on 2 ranks), and nothing written."""
    from ..hf_fixtures import write_text_file

    folder, cut = cut_folders[kind]
    data = write_text_file(tmp_path / "data.txt", lines=40)
    name, *flags = command.split()
    argv = {"train": ["--dataset", data, "--output-dir", tmp_path / "out", "--max-steps", "1",
                      "--precision", "fp32", *flags],
            "evaluate": ["--dataset", data], "generate": ["--chat", "hi"]}[name]
    status, out, err = cli_here(name, "--model", folder, *argv)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(cut) in err and "not a whole safetensors file" in err and "incomplete metadata" in err, err
    assert not (tmp_path / "out").exists()


def test_the_weight_files_checked_are_those_a_load_reads(cut_folders, tmp_path):
    """check_weight_files opens every file the index names (a missing one is one line too), an
    adapter folder's adapters and then its base's weights, and passes whole folders."""
    import shutil

    from hputrain.recipes.hf.folders import check_weight_files, weight_files
    from hputrain.errors import InputError

    sharded, cut = cut_folders["sharded"]
    assert weight_files(sharded) == [cut, sharded / "model-00002-of-00002.safetensors"]
    adapter, _ = cut_folders["base"]
    assert [f.name for f in weight_files(adapter)] == ["adapter_model.safetensors"]
    whole = cut.parent.parent / "whole"
    check_weight_files(whole)  # whole: nothing said
    missing = shutil.copytree(sharded, tmp_path / "missing")
    (missing / "model-00002-of-00002.safetensors").unlink()
    (missing / "model-00001-of-00002.safetensors").write_bytes(
        (whole / "model.safetensors").read_bytes())  # a whole file, as the first shard
    with pytest.raises(InputError, match="model-00002-of-00002.safetensors is missing"):
        check_weight_files(missing, "--ref-model")
