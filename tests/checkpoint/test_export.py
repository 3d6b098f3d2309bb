"""export.save_model writes what `save_pretrained` writes, and the model's own library loads it
back to the same logits: a transformers Llama (whole and in shards), a PEFT LoRA adapter, the
built-in GPT and a plain module; the folder is replaced whole or not at all."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hputrain import Trainer, TrainingArguments
from hputrain.checkpoint import export
from hputrain.errors import InputError
from hputrain.models.gpt import GPT, GPTConfig

from ..hf_fixtures import llama_folder, tiny_tokenizer  # noqa: F401

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")


def token_rows(vocab_size: int, rows: int = 16, length: int = 12, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab_size, (rows, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def train(model, output_dir, steps: int = 2, tokenizer=None, **overrides) -> Trainer:
    """`steps` steps of hputrain's Trainer at a constant, large learning rate (weights move)."""
    args = TrainingArguments(**{
        "output_dir": str(output_dir), "max_steps": steps, "per_device_train_batch_size": 4,
        "learning_rate": 1e-2, "lr_scheduler_type": "constant", "logging_steps": 1,
        "disable_tqdm": True, "save_steps": -1, "throughput_warmup_steps": 0,
        "accelerator": "cpu", **overrides})
    vocab = model.config.vocab_size
    trainer = Trainer(model, args, train_dataset=token_rows(vocab), processing_class=tokenizer)
    trainer.train()
    return trainer


def logits(model, vocab_size: int) -> torch.Tensor:
    ids = torch.randint(4, vocab_size, (2, 10), generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids)
    return out["logits"] if isinstance(out, dict) else out.logits


def load_llama(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def test_trained_llama_reloads_with_from_pretrained(tmp_path, llama_folder):  # noqa: F811
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_folder)
    model = load_llama(llama_folder)
    trainer = train(model, tmp_path / "run", tokenizer=tokenizer)
    trainer.save_model()
    folder = tmp_path / "run" / "final"
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(path.name.startswith(".tmp-") for path in (tmp_path / "run").iterdir())

    reloaded = load_llama(folder)
    vocab = model.config.vocab_size
    expected = logits(model, vocab)
    torch.testing.assert_close(logits(reloaded, vocab), expected, rtol=1e-5, atol=1e-5)
    # the saved weights are the trained ones, not the folder it started from
    assert not torch.allclose(logits(load_llama(llama_folder), vocab), expected, atol=1e-3)
    again = transformers.AutoTokenizer.from_pretrained(folder)
    assert again("the quick fox")["input_ids"] == tokenizer("the quick fox")["input_ids"]


def test_small_max_shard_size_writes_an_index_and_shards_that_reload(tmp_path, llama_folder):  # noqa: F811
    model = load_llama(llama_folder)
    folder = export.save_model(model, tmp_path / "out", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(path.name for path in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert not (folder / "model.safetensors").exists()
    vocab = model.config.vocab_size
    torch.testing.assert_close(logits(load_llama(folder), vocab), logits(model, vocab),
                               rtol=1e-5, atol=1e-5)


def test_tied_llama_embeddings_are_saved_once_and_retied(tmp_path):
    from ..hf_fixtures import tiny_llama_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(300, tie_word_embeddings=True))
    folder = export.save_model(model, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    reloaded = load_llama(folder)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(logits(reloaded, 300), logits(model, 300), rtol=1e-5, atol=1e-5)


def test_lora_save_model_writes_the_adapter_only_and_reloads(tmp_path, llama_folder):  # noqa: F811
    peft = pytest.importorskip("peft", reason="peft is not installed")
    model = peft.get_peft_model(load_llama(llama_folder),
                                peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trainer = train(model, tmp_path / "run")
    trainer.save_model()
    folder = tmp_path / "run" / "final"
    names = {path.name for path in folder.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= names
    assert not names & {"model.safetensors", "model.safetensors.index.json"}
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert saved and all("lora_" in name for name in saved)

    reloaded = peft.PeftModel.from_pretrained(load_llama(llama_folder), folder)
    vocab = model.config.vocab_size
    expected = logits(model, vocab)
    torch.testing.assert_close(logits(reloaded, vocab), expected, rtol=1e-5, atol=1e-5)
    # LoRA's B starts at zero: equal logits to the base would mean the adapter never trained
    assert not torch.allclose(logits(load_llama(llama_folder), vocab), expected, atol=1e-4)


def test_built_in_gpt_writes_config_and_weights_and_reloads(tmp_path):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64)
    model = GPT(config)
    train(model, tmp_path / "run").save_model()
    folder = tmp_path / "run" / "final"
    assert {path.name for path in folder.iterdir()} == {"config.json", "model.safetensors"}
    assert GPTConfig(**json.loads((folder / "config.json").read_text())) == config
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))

    reloaded = GPT.from_pretrained(folder)
    assert reloaded.lm_head.weight is reloaded.wte.weight  # tied again
    torch.testing.assert_close(logits(reloaded, 64), logits(model, 64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(reloaded, 64), logits(GPT.from_pretrained(folder), 64),
                               rtol=0, atol=0)


def test_gpt_from_pretrained_refuses_a_folder_that_is_not_one(tmp_path):
    with pytest.raises(InputError, match="is not a saved GPT") as info:
        GPT.from_pretrained(tmp_path)
    assert "\n" not in str(info.value)
    GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 2, "n_head": 2, "n_embd": 16,
                                                      "block_size": 16}))
    with pytest.raises(InputError, match="does not fit its config.json"):
        GPT.from_pretrained(tmp_path)


def test_any_other_module_is_model_safetensors_alone(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    folder = export.save_model(model, tmp_path / "plain")
    assert [path.name for path in folder.iterdir()] == ["model.safetensors"]
    saved = load_file(str(folder / "model.safetensors"))
    assert saved.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(saved[name], value), name


def test_a_failed_save_leaves_the_old_folder_whole(tmp_path):
    model = torch.nn.Linear(3, 3)
    folder = export.save_model(model, tmp_path / "final")
    before = (folder / "model.safetensors").read_bytes()

    class BrokenTokenizer:
        def save_pretrained(self, path):
            Path(path, "tokenizer.json").write_text("{")
            raise OSError(28, "No space left on device", str(Path(path, "tokenizer.json")))

    with torch.no_grad():
        model.weight.add_(1)
    with pytest.raises(InputError, match="No space left on device") as info:
        export.save_model(model, folder, tokenizer=BrokenTokenizer())
    assert "\n" not in str(info.value)
    assert (folder / "model.safetensors").read_bytes() == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["final"]  # no .tmp- left

    export.save_model(model, folder)  # a save that works replaces it
    assert torch.equal(load_file(str(folder / "model.safetensors"))["weight"], model.weight)


@pytest.mark.parametrize("case", ["file", "parent_is_file", "tokenizer"])
def test_unwritable_output_is_one_input_error_line(tmp_path, case):
    (tmp_path / "f").write_text("x")
    target, tokenizer = {"file": (tmp_path / "f", None),
                         "parent_is_file": (tmp_path / "f" / "final", None),
                         "tokenizer": (tmp_path / "ok", object())}[case]
    with pytest.raises(InputError) as info:
        export.save_model(torch.nn.Linear(2, 2), target, tokenizer=tokenizer)
    assert "\n" not in str(info.value) and str(target.name if case != "tokenizer" else "processing_class") in str(info.value)



FSDP_SCRIPT = '''
import sys
import torch
import transformers
sys.path.insert(0, sys.argv[4])
from hputrain import Trainer, TrainingArguments
out, base, kind = sys.argv[1:4]
model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
if kind == "lora":
    import peft
    torch.manual_seed(11)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
vocab = model.config.vocab_size
ids = torch.randint(4, vocab, (16, 12), generator=torch.Generator().manual_seed(3))
args = TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2,
                         learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
                         disable_tqdm=True, save_steps=2 if kind == "lora" else -1,
                         throughput_warmup_steps=0, accelerator="cpu", strategy="fsdp", ddp_timeout=60, report_to="none")
trainer = Trainer(model, args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
trainer.train()
trainer.save_model()
model.eval()
with torch.no_grad():  # every rank: the sharded model's forward is a collective
    logits = model(input_ids=torch.randint(4, vocab, (2, 10), generator=torch.Generator().manual_seed(7))).logits
if trainer.group.is_main:
    torch.save(logits, out + "/logits.pt")
'''


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_two_process_fsdp_save_model_gathers_the_shards(tmp_path, kind):
    from ..hf_fixtures import tiny_llama_folder
    from ..distributed.test_distributed import ROOT, hputrain_launch

    if kind == "lora":
        pytest.importorskip("peft", reason="peft is not installed")
    base = tiny_llama_folder(tmp_path / "base")
    script = tmp_path / "save_script.py"
    script.write_text(FSDP_SCRIPT)
    proc, _ = hputrain_launch("--nproc-per-node", "2", "--cpu", str(script), str(tmp_path / "run"),
                              str(base), kind, str(ROOT / "src"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "run" / "final"
    if kind == "lora":
        import peft

        assert not (folder / "model.safetensors").exists()
        reloaded = peft.PeftModel.from_pretrained(load_llama(base), folder)
        # the sharded checkpoint of the same step holds the adapter's shards and its files
        step = tmp_path / "run" / "checkpoint-2"
        assert not (step / "model.safetensors").exists() and (step / "sharded").is_dir()
        from_checkpoint = peft.PeftModel.from_pretrained(load_llama(base), step)
        torch.testing.assert_close(logits(from_checkpoint, reloaded.config.vocab_size),
                                   logits(reloaded, reloaded.config.vocab_size), rtol=0, atol=0)
    else:
        reloaded = load_llama(folder)
    expected = torch.load(tmp_path / "run" / "logits.pt", weights_only=True)
    torch.testing.assert_close(logits(reloaded, reloaded.config.vocab_size), expected,
                               rtol=1e-5, atol=1e-5)


class GatheredOnDevice:
    """A stand-in for an fsdp shard (a DTensor) whose gather, `full_tensor`, leaves the whole
    tensor on a device, here the meta device: a copy of it to the host fails, as no rank but the
    writing one may make. Each gather is counted (the collective every rank takes part in)."""

    def __init__(self, whole: torch.Tensor, gathers: list, on_writer: bool):
        self.shape, self.dtype, self.whole = whole.shape, whole.dtype, whole
        self.device_mesh = type("Mesh", (), {"device_type": "meta"})()
        self.gathers, self.on_writer = gathers, on_writer

    def to_local(self):
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def numel(self):
        return self.whole.numel()

    def element_size(self):
        return self.whole.element_size()

    def full_tensor(self):
        self.gathers.append(tuple(self.shape))
        # the writing rank's gather as values (a CPU tensor's .cpu() is itself), the others' on the device
        return self.whole if self.on_writer else torch.empty(self.shape, dtype=self.dtype, device="meta")


def test_the_streamed_writer_copies_to_the_host_on_the_writing_rank_only(tmp_path):
    """Issue 46 item 15: every rank takes part in each tensor's gather, one at a time, and only
    the rank that writes copies it to its host memory (and converts it); another rank drops the
    gathered tensor where the gather left it (it used to copy each one to its host)."""
    from hputrain.checkpoint.streamed import write_safetensors

    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    converted = []

    def convert(name, tensor):
        if not tensor.is_meta:
            converted.append(name)
        return {name: tensor}

    for on_writer in (False, True):
        gathers = []
        entries = {name: GatheredOnDevice(t, gathers, on_writer) for name, t in state.items()}
        path = tmp_path / "model.safetensors" if on_writer else None
        write_safetensors(path, entries, metadata={"format": "pt"}, convert=convert)
        assert gathers == [(3, 4), (5,)]  # every rank gathers each tensor, in order
        assert converted == (["a", "b"] if on_writer else [])
    written = load_file(tmp_path / "model.safetensors")
    assert written.keys() == state.keys() and all(torch.equal(written[k], state[k]) for k in state)


@pytest.mark.parametrize("max_shard_size", [pytest.param(None, marks=pytest.mark.slow), 40_000])
def test_fsdp_export_and_consolidate_hold_one_whole_tensor_at_a_time(tmp_path, max_shard_size):
    """Issue 39 item 15: rank 0 writes final/ (export.save_model) and a checkpoint's
    model.safetensors (ShardedState.consolidate) of a 2-rank fsdp Llama gathering, writing and
    dropping one tensor at a time: the most bytes alive at once that the write made on rank 0 is
    its largest tensor, and less than twice it (the whole model before); rank 1 asks for no host
    copy of any (issue 46 item 15); and both files hold torch's full state dict,
    final/ laid out as transformers' own save_pretrained lays out those weights (one file, or
shards and an index past max_shard_size), and from_pretrained loading it."""
    from ..distributed.test_distributed import hputrain_launch

    script = Path(__file__).parents[1] / "streamed_export_script.py"
    extra = [] if max_shard_size is None else ["--max-shard-size", str(max_shard_size)]
    proc, _ = hputrain_launch("--nproc-per-node", "2", "--cpu", str(script), str(tmp_path), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = json.loads((tmp_path / "peaks.json").read_text())
    # issue 46 item 15: rank 0 copies each tensor to its host once; rank 1, which writes
    # nothing, copies none (it took part in each gather)
    copied = [json.loads((tmp_path / f"host_copies_rank{r}.json").read_text()) for r in (0, 1)]
    assert copied[1] == {"final": 0, "consolidate": 0}, copied
    assert all(copied[0][written] >= peaks["model"] for written in ("final", "consolidate")), copied
    for written in ("final", "consolidate"):  # the largest tensor, and maybe part of the next
        assert peaks["largest"] <= peaks[written] < min(2 * peaks["largest"], peaks["model"] / 4), peaks
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    consolidated = load_file(tmp_path / "model.safetensors")
    assert consolidated.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(consolidated[name], tensor), name
    from ..hf_fixtures import tiny_llama_config

    whole = transformers.LlamaForCausalLM(tiny_llama_config(256, num_hidden_layers=4))
    whole.load_state_dict(expected)
    whole.save_pretrained(tmp_path / "reference", max_shard_size=max_shard_size or "5GB")
    files = sorted(p.name for p in (tmp_path / "final").glob("model*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "reference").glob("model*.safetensors"))
    assert len(files) == (1 if max_shard_size is None else 6)
    for file in files:
        assert load_file(tmp_path / "final" / file).keys() == load_file(tmp_path / "reference" / file).keys()
    index = "model.safetensors.index.json"
    if max_shard_size is not None:
        mine, theirs = (json.loads((tmp_path / d / index).read_text()) for d in ("final", "reference"))
        assert mine == theirs
    assert (tmp_path / "final" / index).exists() == (max_shard_size is not None)
    reloaded = load_llama(tmp_path / "final")
    state = reloaded.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
