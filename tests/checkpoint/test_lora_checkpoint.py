"""Checkpoints of a PEFT LoRA model hold its trainable parameters (the adapter) and their
optimizer state, not a copy of the frozen base; they resume exactly into a model built again from
the base, refuse another adapter in one line, and load as an adapter with PeftModel."""
import json

import pytest
import torch
from safetensors.torch import load_file

from hputrain.checkpoint import saving as checkpoint
from hputrain.checkpoint.folder import (MODEL_FILE, SHARDED_DIR, TRAINABLE_FILE, TRAINABLE_RECORD,
                                        CheckpointError)
from hputrain.checkpoint.sharded import ShardedState, export_model, load_metadata

from ..hf_fixtures import llama_folder  # noqa: F401
from ..checkpoint.test_export import load_llama, logits, train

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")


def lora(folder, targets=("q_proj", "v_proj")):
    """A LoRA model on a fresh copy of the base in `folder` (B starts at zero: no seed needed,
    but A is drawn: the seed makes two builds equal)."""
    torch.manual_seed(11)
    return peft.get_peft_model(load_llama(folder), peft.LoraConfig(r=8, target_modules=list(targets)))


def adapter(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()
            if param.requires_grad}


def test_lora_training_changes_only_the_adapter(tmp_path, llama_folder):  # noqa: F811
    model = lora(llama_folder)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    train(model, tmp_path, steps=2)
    changed = {name for name, value in model.state_dict().items()
               if not torch.equal(value, before[name])}
    assert changed and all("lora_B" in name or "lora_A" in name for name in changed)
    assert any("lora_B" in name for name in changed)  # B left zero would mean no training
    trainable = set(adapter(model))
    assert all(name in trainable for name in changed)


def test_lora_checkpoint_holds_the_adapter_not_the_base(tmp_path, llama_folder):  # noqa: F811
    model = lora(llama_folder)
    train(model, tmp_path, steps=2, save_steps=2)
    folder = tmp_path / "checkpoint-2"
    names = {path.name for path in folder.iterdir()}
    assert MODEL_FILE not in names
    assert {TRAINABLE_FILE, TRAINABLE_RECORD, "adapter_config.json",
            "adapter_model.safetensors", "optimizer.pt", "config.json"} <= names
    saved = load_file(str(folder / TRAINABLE_FILE))
    assert set(saved) == set(adapter(model))  # the trainable parameters, no base weight name
    record = json.loads((folder / TRAINABLE_RECORD).read_text())
    assert record["parameters"] == list(saved)
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(saved)
    base = (llama_folder / "model.safetensors").stat().st_size
    weights = sum(path.stat().st_size for path in folder.glob("*.safetensors"))  # both copies
    assert weights < base / 8, (weights, base)

    # the checkpoint folder is an adapter folder for PEFT, with the step-2 logits
    vocab = model.config.vocab_size
    reloaded = peft.PeftModel.from_pretrained(load_llama(llama_folder), folder)
    torch.testing.assert_close(logits(reloaded, vocab), logits(model, vocab), rtol=1e-5, atol=1e-5)


def test_lora_resume_equals_a_straight_run(tmp_path, llama_folder):  # noqa: F811
    straight = lora(llama_folder)
    train(straight, tmp_path / "straight", steps=6, save_steps=-1)
    stopped = tmp_path / "stopped"
    train(lora(llama_folder), stopped, steps=3, save_steps=3)
    resumed = lora(llama_folder)
    with torch.no_grad():  # the resumed adapter must come from the checkpoint, not the build
        for param in resumed.parameters():
            if param.requires_grad:
                param.add_(1.0)
    train(resumed, stopped, steps=6, save_steps=3, resume_from_checkpoint="checkpoint-3")
    want, got = adapter(straight), adapter(resumed)
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    base = lora(llama_folder)  # and the frozen base is the one it was built from
    for (name, a), b in zip(base.state_dict().items(), resumed.state_dict().values()):
        if "lora_" not in name:
            assert torch.equal(a, b), name


def test_a_checkpoint_of_another_adapter_is_one_line(tmp_path, llama_folder):  # noqa: F811
    train(lora(llama_folder), tmp_path, steps=2, save_steps=2)
    other = lora(llama_folder, targets=("q_proj", "k_proj"))
    with pytest.raises(CheckpointError, match="trainable parameters are not the model's") as info:
        checkpoint.load_checkpoint(tmp_path / "checkpoint-2", model=other)
    message = str(info.value)
    assert "\n" not in message and "k_proj" in message and "v_proj" in message
    with pytest.raises(CheckpointError, match="trainable parameters are not the model's"):
        checkpoint.load_checkpoint(tmp_path / "checkpoint-2", model=load_llama(llama_folder))


def test_a_fully_trainable_model_keeps_its_files(tmp_path, llama_folder):  # noqa: F811
    model = load_llama(llama_folder)
    folder = checkpoint.save_checkpoint(tmp_path, 1, model=model, optimizer=None, scheduler=None,
                                        state={}, accelerator=None)
    names = {path.name for path in folder.iterdir()}
    assert MODEL_FILE in names
    assert not names & {TRAINABLE_FILE, TRAINABLE_RECORD, "adapter_config.json"}


def test_sharded_state_of_a_lora_holds_and_resumes_the_adapter(tmp_path, llama_folder):  # noqa: F811
    model = lora(llama_folder)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(4, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = checkpoint.save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, scheduler=None,
                                        state={}, accelerator=None, state_io=ShardedState(),
                                        consolidate=True)
    saved = [key for key in load_metadata(folder / SHARDED_DIR).state_dict_metadata
             if key.startswith("model.")]
    assert sorted(key[len("model."):] for key in saved) == sorted(adapter(model))
    assert not (folder / MODEL_FILE).exists()  # no consolidated copy of the base
    assert (folder / "adapter_model.safetensors").is_file()
    with pytest.raises(CheckpointError, match="only the trainable parameters"):
        export_model(folder)  # `hputrain export`: there is no whole model to write

    resumed = lora(llama_folder)
    optimizer2 = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2)
    checkpoint.load_checkpoint(folder, model=resumed, optimizer=optimizer2, state_io=ShardedState())
    for name, value in adapter(model).items():
        assert torch.equal(adapter(resumed)[name], value), name
    for step in (optimizer, optimizer2):  # one more step each: the optimizer state came back too
        owner = model if step is optimizer else resumed
        owner(input_ids=ids, labels=ids).loss.backward()
        step.step()
    for name, value in adapter(model).items():
        assert torch.equal(adapter(resumed)[name], value), name


@pytest.mark.slow
def test_two_process_fsdp_lora_resume_equals_a_straight_run(tmp_path):
    """LoRA under fsdp on 2 processes (tests/fsdp_lora_script.py): 4 steps, then new processes
    resuming from the sharded checkpoint-4 to step 6, end on the adapter of 6 straight steps,
    bitwise, with the same losses. LoRA dropout is on, so each rank's RNG must come back too; the
    learning rate is constant, since a 4-step run's decaying schedule is not a 6-step run's."""
    from ..hf_fixtures import tiny_llama_folder
    from ..distributed.test_distributed import ROOT, hputrain_launch

    base = tiny_llama_folder(tmp_path / "base")
    script = str(ROOT / "tests" / "fsdp_lora_script.py")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    first, _ = hputrain_launch("--nproc-per-node", "2", "--cpu", script, str(base), f"{straight},6",
                               f"{stopped},4")
    assert first.returncode == 0, first.stderr[-3000:]
    halfway = stopped / "checkpoint-4"
    assert (halfway / SHARDED_DIR).is_dir() and not (halfway / MODEL_FILE).exists()
    at_four = torch.load(stopped / "adapter.pt")
    second, _ = hputrain_launch("--nproc-per-node", "2", "--cpu", script, str(base),
                                f"{stopped},6,{halfway}")
    assert second.returncode == 0, second.stderr[-3000:]
    want, got = torch.load(straight / "adapter.pt"), torch.load(stopped / "adapter.pt")
    assert want.keys() == got.keys() and all("lora_" in name for name in want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
        assert not torch.equal(at_four[name], value), name  # steps 5 and 6 moved every adapter weight

    def losses(folder):
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}
    assert losses(stopped) == losses(straight) and sorted(losses(straight)) == [1, 2, 3, 4, 5, 6]
