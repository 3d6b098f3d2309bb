"""Hugging Face folders under strategy="fsdp" across processes: built on the meta device, each rank
filling its own shards from the safetensors files (checkpoint/hf_weights.py, recipes/hf/sharded.py).
The reference is `from_pretrained(dtype=float32)` (and PEFT's adapters drawn after the same seed),
compared bit for bit; the 2-process cases run tests/sharded_loading_script.py."""
from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
import torch

from ..hf_fixtures import _transformers_major, tiny_llama_folder
from ..distributed.test_distributed import ROOT, hputrain_launch

pytest.importorskip("transformers")
pytest.importorskip("peft")
SCRIPT = str(ROOT / "tests" / "sharded_loading_script.py")


def reference(folder, lora: bool = False) -> dict:
    """What recipes/hf/__init__.py loads in one process: from_pretrained, LoRA r=4 after manual_seed(0)."""
    from hputrain.recipes import hf

    torch.manual_seed(0)
    path = folder
    if hf.is_adapter_folder(path):
        model, _ = hf.load_model(path, trainable=True)
    else:
        model, _ = hf.load_model(path)
    if lora:
        model = hf.add_lora(model, hf.HFOptions(model=str(folder), dataset="unused", lora_r=4))
    return {name: t.detach() for name, t in model.state_dict().items()}


def assert_bit_equal(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype == torch.float32, name
        assert torch.equal(actual[name], value), name


def assert_no_whole_parameter_read(out, name: str, folder, ranks: int = 2) -> None:
    """Every read of a tensor with at least `ranks` rows took at most ceil(rows / ranks) of them,
    and the ranks' reads of each tensor are disjoint and cover it (a reference read again
    reads the same rows)."""
    from safetensors import safe_open

    shapes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            shapes |= {key: handle.get_slice(key).get_shape() for key in handle.keys()}
    covered: dict[str, set[tuple[int, int]]] = {}
    for rank in range(ranks):
        for read in json.loads((out / f"{name}.reads.{rank}.json").read_text()):
            rows = shapes[read["key"]][0]
            start, stop = read["index"][0]
            assert stop - start <= math.ceil(rows / ranks), read
            assert read["shape"][0] == stop - start
            covered.setdefault(read["key"], set()).add((start, stop))
    for key, spans in covered.items():
        spans = sorted(spans)
        assert spans[0][0] == 0 and spans[-1][1] == shapes[key][0], key
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), key


def launch(out, *cases):
    proc, _ = hputrain_launch("--cpu", "--nproc-per-node", "2", SCRIPT, str(out), *cases, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny Llamas: untied and tied (lm_head = embed_tokens, the file holding one), fp32; a bf16
    copy of the untied one in the sharded form (model.safetensors.index.json)."""
    import transformers

    root = tmp_path_factory.mktemp("sharded-loading")
    made = {"untied": tiny_llama_folder(root / "untied"),
            "tied": tiny_llama_folder(root / "tied", seed=1, tie_word_embeddings=True)}
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(made["untied"], dtype=torch.bfloat16)
    bf16.save_pretrained(root / "bf16", max_shard_size="20KB")
    for file in made["untied"].glob("*token*"):
        shutil.copy(file, root / "bf16")
    made["bf16"] = root / "bf16"
    assert (made["bf16"] / "model.safetensors.index.json").is_file()
    return made


def test_two_ranks_load_a_tied_lora_model_bit_for_bit_without_a_whole_parameter(tmp_path, folders):
    """The representative: a tied Llama with LoRA on 2 ranks equals one process's load, and no
    rank read more than its half of any tensor."""
    launch(tmp_path, f"tied,{folders['tied']},lora")
    assert json.loads((tmp_path / "tied.json").read_text())["on_meta"]
    actual = torch.load(tmp_path / "tied.pt")
    assert_bit_equal(reference(folders["tied"], lora=True), actual)
    assert torch.equal(actual["base_model.model.lm_head.weight"],
                       actual["base_model.model.model.embed_tokens.weight"])
    assert_no_whole_parameter_read(tmp_path, "tied", folders["tied"])


@pytest.mark.slow
def test_two_ranks_load_untied_bf16_adapter_and_reference_bit_for_bit(tmp_path, folders):
    import peft

    from hputrain.recipes import hf

    adapter = tmp_path / "adapter"  # an adapter folder as --model: training continues on it
    torch.manual_seed(5)
    base, _ = hf.load_model(folders["untied"])
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # zero-initialised B would not show its values were loaded
    model.save_pretrained(adapter)
    launch(tmp_path, f"untied,{folders['untied']},ref", f"untied-lora,{folders['untied']},lora",
           f"bf16,{folders['bf16']}", f"bf16-lora,{folders['bf16']},lora", f"adapter,{adapter}")
    assert_bit_equal(reference(folders["untied"]), torch.load(tmp_path / "untied.pt"))
    assert_bit_equal(reference(folders["untied"]), torch.load(tmp_path / "untied.ref.pt"))
    assert_bit_equal(reference(folders["untied"], lora=True), torch.load(tmp_path / "untied-lora.pt"))
    assert_bit_equal(reference(folders["bf16"]), torch.load(tmp_path / "bf16.pt"))
    assert_bit_equal(reference(folders["bf16"], lora=True), torch.load(tmp_path / "bf16-lora.pt"))
    assert_bit_equal(reference(adapter), torch.load(tmp_path / "adapter.pt"))
    for name, folder in [("untied", folders["untied"]), ("bf16-lora", folders["bf16"])]:
        assert_no_whole_parameter_read(tmp_path, name, folder)


def renamed_folder(source, target, drop: str | None = None):
    """`source` with its tensors under the base model's names (no `model.` prefix, no lm_head):
    from_pretrained maps them (the model is tied), and so does the sharded loader, which follows
    its renaming; `drop` (a base-model name) left out of the file as well."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    state = load_file(target / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in state.items()
               if k != "lm_head.weight" and k.removeprefix("model.") != drop},
              target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.skipif(_transformers_major() < 5, reason="transformers 4 has no key mapping to follow: "
                    "such a folder falls back to from_pretrained there (the next test)")
def test_base_model_names_load_shard_by_shard_as_from_pretrained_maps_them(tmp_path, folders):
    from hputrain.distributed.fsdp import materialise, weight_source
    from hputrain.recipes import hf

    model, _ = hf.load_model(renamed_folder(folders["tied"], tmp_path / "renamed"), sharded=True)
    assert all(p.is_meta for p in model.parameters())
    materialise(model, torch.device("cpu"), 0, weight_source(model))
    assert_bit_equal(reference(folders["tied"]), {k: v.detach() for k, v in model.state_dict().items()})


def test_names_that_do_not_map_fall_back_to_from_pretrained_with_one_line(tmp_path, folders, capsys):
    from hputrain.recipes import hf

    folder = renamed_folder(folders["tied"], tmp_path / "renamed", drop="norm.weight")
    model, _ = hf.load_model(folder, sharded=True)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "every rank loads the whole model" in out[0]
    # transformers 5 maps the other base-model names onto the model's; 4 maps none of them
    missing = "model.norm.weight" if _transformers_major() >= 5 else "model.embed_tokens.weight"
    assert f"{missing} is not among the files' tensors" in out[0]
    assert not any(p.is_meta for p in model.parameters())
    # from_pretrained draws the missing norm as the model's init does: ones, as it was saved
    assert_bit_equal(reference(folders["tied"]), {k: v.detach() for k, v in model.state_dict().items()})


def test_one_process_fills_a_meta_model_as_from_pretrained(folders):
    """The same source without sharding (whole tensors): the meta build keeps the rotary buffers."""
    from hputrain.distributed.fsdp import materialise, weight_source
    from hputrain.recipes import hf

    torch.manual_seed(0)
    model, _ = hf.load_model(folders["bf16"], sharded=True)
    model = hf.add_lora(model, hf.HFOptions(model="unused", dataset="unused", lora_r=4))
    assert model.get_base_model().model.rotary_emb.inv_freq.device.type == "cpu"
    materialise(model, torch.device("cpu"), 0, weight_source(model))
    assert_bit_equal(reference(folders["bf16"], lora=True), {k: v.detach() for k, v in model.state_dict().items()})


def test_a_folder_without_safetensors_falls_back(tmp_path, folders):
    from hputrain.checkpoint.hf_weights import FolderWeights

    shutil.copytree(folders["untied"], tmp_path / "bin")
    (tmp_path / "bin" / "model.safetensors").unlink()
    assert "no model.safetensors" in FolderWeights.match(tmp_path / "bin", torch.nn.Linear(2, 2))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
