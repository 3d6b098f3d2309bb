"""Mixture-of-experts folders loaded shard by shard and saved back (issue 40 item 6).

transformers 5 fuses the experts that a folder stores apart (Mixtral's
block_sparse_moe.experts.N.w1/w2/w3, Qwen's, OLMoE's and DeepSeek's mlp.experts.N.*_proj) into
3-D parameters as it loads them. The sharded loader follows that conversion
(checkpoint/hf_conversion.py): the reference is `from_pretrained(dtype=float32)`, compared bit for
bit, and each rank must read each byte of the files it needs and no other (every byte of the
folder read exactly once across the ranks). final/ is written in the form on disk, compared by
the logits from_pretrained(final) gives against the trained model's."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from ...moe_fixtures import moe_folders, mxfp4_folder, tiny_moe_config, to_mxfp4  # noqa: F401
from ...distributed.test_distributed import ROOT, hputrain_launch
from ...recipes.test_sharded_loading import assert_bit_equal, launch, reference

transformers = pytest.importorskip("transformers")
FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")
BATCH = torch.arange(2, 34).reshape(2, 16)


def write_folder(folder, family: str, seed: int = 0, **save_options):
    """A tiny folder of `family` as save_pretrained writes it (the experts apart, in each expert's
    on-disk names), every persistent buffer drawn too (DeepSeek-V3's e_score_correction_bias,
    which real checkpoints hold and the model's init sets to zeros)."""
    from ...hf_fixtures import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family, len(tokenizer)))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in model.state_dict() and buffer.is_floating_point():
                buffer.normal_()
    model.save_pretrained(folder, **save_options)
    tokenizer.save_pretrained(folder)
    return folder


def fused_folder(source, folder):
    """`source` with its weights in the fused form (the model's own parameter names, one 3-D
    tensor per layer's experts), which from_pretrained also reads."""
    from safetensors.torch import save_file

    shutil.copytree(source, folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    for file in folder.glob("model*.safetensors*"):
        file.unlink()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def tensor_shapes(folder) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            shapes |= {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    return shapes


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-loading")
    made = {family: write_folder(root / family, family) for family in FAMILIES}
    made["mixtral-index"] = write_folder(root / "mixtral-index", "mixtral", seed=1, max_shard_size="40KB")
    made["mixtral-fused"] = fused_folder(made["mixtral"], root / "mixtral-fused")
    made["gpt_oss-mxfp4"] = mxfp4_folder(root / "gpt_oss-mxfp4")  # as openai publishes GPT-OSS
    for family in FAMILIES:  # the folders hold each expert apart, as real checkpoints do
        assert any(re.search(r"experts\.\d+\.", key) for key in tensor_shapes(made[family])), family
    assert (made["mixtral-index"] / "model.safetensors.index.json").is_file()
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensor_shapes(made["mixtral-fused"])
    return made


class Reads:
    """FolderWeights.read recorded: (tensor name, the slices read)."""

    def __init__(self, monkeypatch):
        from hputrain.checkpoint.hf_weights import FolderWeights

        self.log: list[tuple[str, tuple[tuple[int, int], ...]]] = []
        read = FolderWeights.read

        def recording(source, key, index):
            self.log.append((key, tuple((s.start, s.stop) for s in index)))
            return read(source, key, index)

        monkeypatch.setattr(FolderWeights, "read", recording)


def filled_on_one_process(folder) -> dict:
    from hputrain.distributed.fsdp import materialise, weight_source
    from hputrain.recipes import hf

    model, _ = hf.load_model(folder, sharded=True)
    assert all(p.is_meta for p in model.parameters()), "fell back to loading the whole model"
    materialise(model, torch.device("cpu"), 0, weight_source(model))
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", [*FAMILIES, "mixtral-index", "mixtral-fused"])
def test_the_sharded_loader_gives_what_from_pretrained_gives(folders, name, capsys):
    """Experts apart (each family's names, an index over several files) or already fused: the
    meta model filled from the files equals from_pretrained bit for bit, with no fallback line."""
    assert_bit_equal(reference(folders[name]), filled_on_one_process(folders[name]))
    assert "every rank loads the whole model" not in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "llama4_text"])
def test_the_other_families_load_as_from_pretrained(moe_folders, family, capsys):
    """Qwen2-MoE (experts apart, a shared expert), GPT-OSS and Llama 4 (experts fused on disk,
    with biases and transposed weights): the same bit for bit."""
    assert_bit_equal(reference(moe_folders(family)), filled_on_one_process(moe_folders(family)))
    assert "every rank loads the whole model" not in capsys.readouterr().out


def test_deepseek_correction_bias_is_loaded_from_the_files(folders):
    """A persistent buffer the files hold is theirs, not the constructor's zeros."""
    state = filled_on_one_process(folders["deepseek_v3"])
    bias = state["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0
    assert torch.equal(bias, reference(folders["deepseek_v3"])["model.layers.1.mlp.gate.e_score_correction_bias"])


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "mixtral-fused"])
def test_read_experts_reads_those_experts_only(folders, name, monkeypatch):
    """What expert parallelism asks: experts 2-4 of a layer, equal to from_pretrained's rows, from
    experts 2-4's tensors read whole (stored apart) or rows 2-4 of the fused one, nothing else."""
    from hputrain.checkpoint.hf_weights import read_experts
    from hputrain.recipes.hf.sharded import parameters_on_meta

    expected = reference(folders[name])
    config = transformers.AutoConfig.from_pretrained(folders[name])
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reads = Reads(monkeypatch)
    for param in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{param}"
        part = read_experts(folders[name], model, key, range(2, 5))
        assert torch.equal(part, expected[key][2:5])
    shapes = tensor_shapes(folders[name])
    for key, index in reads.log:
        expert = re.search(r"experts\.(\d+)\.", key)
        if expert:  # one expert's tensor, read whole
            assert 2 <= int(expert.group(1)) <= 4 and index == tuple((0, n) for n in shapes[key])
        else:  # the fused tensor: rows 2-4 only
            assert index[0] == (2, 5) and index[1:] == tuple((0, n) for n in shapes[key][1:])
    assert {key for key, _ in reads.log} <= {k for k in shapes if ".layers.1." in k}
    assert len(reads.log) == (2 if name == "mixtral-fused" else 9)  # 3 experts × (w1, w3, w2)


def test_a_part_across_gate_and_up_reads_the_rows_of_each(folders, monkeypatch):
    """Any box of a fused parameter (a shard along another dimension than the experts'): rows
    50-80 of gate_up_proj (intermediate 64) are rows 50-63 of w1 and 0-15 of w3, of experts 1-2."""
    from hputrain.checkpoint.hf_weights import FolderWeights
    from hputrain.recipes.hf.sharded import parameters_on_meta

    config = transformers.AutoConfig.from_pretrained(folders["mixtral"])
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = FolderWeights.match(folders["mixtral"], model)
    reads = Reads(monkeypatch)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    part = source.read_part(key, (slice(1, 3), slice(50, 80), slice(5, 20)))
    assert torch.equal(part, reference(folders["mixtral"])[key][1:3, 50:80, 5:20])
    assert sorted(reads.log) == sorted(
        (f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight", (rows, (5, 20)))
        for e in (1, 2) for w, rows in (("w1", (50, 64)), ("w3", (0, 16))))


def test_a_conversion_it_cannot_follow_falls_back_with_one_line(folders, monkeypatch, capsys):
    """An operation of transformers' mapping that the loader does not know: the whole model on
    every rank, as before, with one line naming it."""
    from transformers import core_model_loading

    from hputrain.recipes import hf

    monkeypatch.setattr(core_model_loading, "MergeModulelist", type("Other", (), {}))
    model, _ = hf.load_model(folders["olmoe"], sharded=True)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "every rank loads the whole model" in out[0]
    assert "uses MergeModulelist, which hputrain does not follow part by part" in out[0]
    assert not any(p.is_meta for p in model.parameters())


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=BATCH).logits


def test_streamed_writing_gives_the_files_save_pretrained_gives(folders, tmp_path):
    """export's writer, one tensor at a time through transformers' reverse conversion: the same
    tensors under the same names as save_pretrained, and from_pretrained of it the same logits."""
    from safetensors.torch import load_file

    from hputrain.checkpoint.hf_conversion import DiskForm
    from hputrain.checkpoint.streamed import each_once_by_identity, placeholder, write_safetensors

    model = transformers.AutoModelForCausalLM.from_pretrained(folders["qwen3_moe"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "theirs")
    (tmp_path / "ours").mkdir()
    shutil.copy(tmp_path / "theirs" / "config.json", tmp_path / "ours")
    entries = each_once_by_identity(model)
    form = DiskForm.of(model, {name: placeholder(t) for name, t in entries.items()})
    assert form.names["model.norm.weight"] == ["model.norm.weight"]  # written as it is
    assert len(form.names["model.layers.0.mlp.experts.gate_up_proj"]) == 16  # 8 experts × gate, up
    write_safetensors(tmp_path / "ours" / "model.safetensors", entries, metadata={"format": "pt"},
                      convert=form)
    theirs, ours = (load_file(tmp_path / n / "model.safetensors") for n in ("theirs", "ours"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert torch.equal(logits_of(loaded), logits_of(model))


def test_one_process_final_round_trip(folders, tmp_path):
    """Trained 2 steps in one process from a Mixtral folder with its experts apart: final/ holds
    them apart again, and from_pretrained(final) gives the trained model's logits."""
    from hputrain import Trainer, TrainingArguments
    from hputrain.checkpoint.export import save_model
    from hputrain.recipes import hf

    from ...moe_export_script import rows

    model, tokenizer = hf.load_model(folders["mixtral"])
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-2, save_steps=-1, disable_tqdm=True, accelerator="cpu",
                             report_to="none")
    trainer = Trainer(model, args, train_dataset=rows())
    trainer.train()
    final = save_model(trainer.model, tmp_path / "final", tokenizer)
    assert tensor_shapes(final).keys() == tensor_shapes(folders["mixtral"]).keys()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    trained = logits_of(trainer.model)
    assert not torch.equal(trained, logits_of(transformers.AutoModelForCausalLM.from_pretrained(
        folders["mixtral"], dtype=torch.float32)))
    # the trained model runs hputrain's static experts, the loaded one transformers' default:
    # the same weights, summed in another order
    torch.testing.assert_close(logits_of(loaded), trained, rtol=1e-5, atol=1e-6)


# -- several processes ---------------------------------------------------------------------------

def assert_each_byte_read_once(out, name: str, folder, ranks: int = 2) -> None:
    """Across the ranks every element of the folder's tensors was read exactly once; each rank
    read at most its share (half, rounded up per tensor), and of the experts stored apart, rank
    r read only its own: experts [r·E/2, (r+1)·E/2) of each layer (fsdp cuts the fused experts
    parameter along the experts). A persistent buffer (DeepSeek-V3's correction bias) is not
    sharded: every rank reads it whole."""
    shapes = tensor_shapes(folder)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    buffers = {name for name, _ in model.named_buffers()} & set(model.state_dict())
    counts = {key: torch.zeros(shape, dtype=torch.int32) for key, shape in shapes.items()}
    experts = 1 + max((int(m.group(1)) for k in shapes if (m := re.search(r"experts\.(\d+)\.", k))), default=-1)
    for rank in range(ranks):
        read = 0
        for entry in json.loads((out / f"{name}.reads.{rank}.json").read_text()):
            index = tuple(slice(a, b) for a, b in entry["index"])
            counts[entry["key"]][index] += 1
            read += counts[entry["key"]][index].numel() if entry["key"] not in buffers else 0
            expert = re.search(r"experts\.(\d+)\.", entry["key"])
            if expert:
                assert rank * experts // ranks <= int(expert.group(1)) < (rank + 1) * experts // ranks, entry
        assert read <= sum(-(-t.numel() // ranks) for k, t in counts.items() if k not in buffers), (rank, read)
    for key, count in counts.items():
        assert bool((count == (ranks if key in buffers else 1)).all()), key


@pytest.mark.slow
def test_two_ranks_load_each_family_bit_for_bit_reading_each_byte_once(tmp_path, folders):
    """Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 (experts apart), a Mixtral over several files and a
    fused one, under fsdp on 2 processes: equal to from_pretrained, each byte read by one rank.
    With expert parallelism (2 ranks, fsdp on the rest: "mixtral-ep"), each rank reads its own
    experts, 0-3 and 4-7, through the views the strategy gives the split experts."""
    names = [*FAMILIES, "mixtral-index", "mixtral-fused"]
    launch(tmp_path, *(f"{name},{folders[name]}" for name in names), f"mixtral-ep,{folders['mixtral']},ep")
    for name in [*names, "mixtral-ep"]:
        folder = folders[name.removesuffix("-ep")]
        assert json.loads((tmp_path / f"{name}.json").read_text())["on_meta"], name
        assert_bit_equal(reference(folder), torch.load(tmp_path / f"{name}.pt"))
        assert_each_byte_read_once(tmp_path, name, folder)


@pytest.mark.slow
def test_fsdp_final_round_trip_on_two_processes(tmp_path, folders):
    """Trained 2 steps under fsdp on 2 processes from a Mixtral folder with its experts apart,
    written by the streamed writer: final/ holds the experts apart under the folder's names,
    from_pretrained(final) gives the trained model's weights and logits, and rank 0 never held
    more than one whole parameter (and its pieces) on the way to the file."""
    proc, _ = hputrain_launch("--cpu", "--nproc-per-node", "2", str(ROOT / "tests" / "moe_export_script.py"),
                              str(tmp_path), str(folders["mixtral"]), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = torch.load(tmp_path / "trained.pt")
    final = tmp_path / "final"
    assert tensor_shapes(final).keys() == tensor_shapes(folders["mixtral"]).keys()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert_bit_equal(trained["state"], {k: v.detach() for k, v in loaded.state_dict().items()})
    assert not torch.equal(trained["state"]["model.layers.0.mlp.experts.gate_up_proj"],
                           reference(folders["mixtral"])["model.layers.0.mlp.experts.gate_up_proj"])
    # the same weights bit for bit (above); the logits of two processes of different thread counts
    # (a worker runs 1 OpenMP thread, this process 2) may differ in the last bits of a sum
    torch.testing.assert_close(logits_of(loaded), trained["logits"], rtol=1e-5, atol=1e-5)
    # one whole parameter at a time, and the copy transformers' reverse conversion makes of it
    # (its Chunk of gate_up_proj into gate and up is contiguous): not the whole model
    peaks = json.loads((tmp_path / "peaks.json").read_text())
    assert peaks["final"] < 2.1 * peaks["largest"] < peaks["model"], peaks


@pytest.mark.slow
def test_the_issue_command_line_loads_mixtral_shard_by_shard(tmp_path, folders):
    """`hputrain train --devices 2 --strategy fsdp` on a Mixtral folder: no rank loads the whole
    model (the issue's line is gone), and final/ is a folder from_pretrained reads whole (every
    tensor of the model found, under the names of the folder it started from)."""
    from ...hf_fixtures import write_text_file

    data = write_text_file(tmp_path / "rows.txt", lines=40)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu", "--model",
                           str(folders["mixtral"]), "--dataset", str(data), "--devices", "2",
                           "--strategy", "fsdp", "--max-steps", "2", "--per-device-train-batch-size", "1",
                           "--validation-split-percentage", "0", "--disable-tqdm", "--precision", "fp32",
                           "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "every rank loads the whole model" not in proc.stdout + proc.stderr
    final = out / "final"
    assert tensor_shapes(final).keys() == tensor_shapes(folders["mixtral"]).keys()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_each_operation_reads_what_transformers_operations_give():
    """The operations no MoE fixture uses here (Transpose, Chunk) and a chain of them: any part
    of the result, read through the nodes, equals that part of what transformers' own
    WeightConverter.convert makes of the same tensors."""
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, Transpose, WeightConverter

    from hputrain.checkpoint.hf_conversion import Leaf, _converted

    g = torch.Generator().manual_seed(0)
    stored = {f"layers.0.experts.{e}.{w}.weight": torch.randn(6, 4, generator=g)
              for e in range(3) for w in ("w1", "w3")} | {"layers.0.attn.qkv.weight": torch.randn(9, 4, generator=g)}
    cases = [
        (WeightConverter(["experts.*.w1.weight", "experts.*.w3.weight"], "experts.gate_up_proj",
                         [MergeModulelist(dim=0), Concatenate(dim=1), Transpose(1, 2)]),
         "layers.0.experts.gate_up_proj", "experts"),
        (WeightConverter("attn.qkv.weight", ["attn.q.weight", "attn.k.weight", "attn.v.weight"], [Chunk(dim=0)]),
         "layers.0.attn.q.weight", "qkv"),
    ]
    for converter, first, part in cases:
        inputs: dict[str, list] = {}
        for key in sorted(k for k in stored if part in k):
            _, pattern = converter.rename_source_key(key)
            inputs.setdefault(pattern, []).append(key)
            converter.add_tensor(first, key, pattern, stored[key])
        expected = converter.convert(first)
        nodes = _converted(converter, first, {p: [Leaf(k, stored[k].shape) for k in keys]
                                              for p, keys in inputs.items()}, model=None)
        assert nodes.keys() == expected.keys()
        for name, node in nodes.items():
            whole = expected[name]
            assert node.shape == tuple(whole.shape), name
            box = tuple(slice(n // 3, n - n // 4) for n in whole.shape)
            read = node.read(box, lambda key, index: stored[key][index])
            assert torch.equal(read, whole[box]), name


# -- MXFP4 folders (GPT-OSS as published: the experts as 4-bit blocks and their scales) -----------

def test_the_mxfp4_writer_gives_what_transformers_dequantizes_back():
    """The fixture's writer is MXFP4 as transformers reads it: values that MXFP4 holds exactly
    (an E2M1 value times a power of two per group of 32) come back bit for bit from transformers'
    own dequantization (integrations/mxfp4.py), in the model's experts × in × out layout."""
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    experts, inner, out = 3, 96, 10  # 3 groups of 32 along the inputs
    codes = torch.randint(0, 16, (experts, out, inner), generator=g)
    powers = torch.randint(-8, 4, (experts, out, inner // 32), generator=g).repeat_interleave(32, dim=-1)
    values = torch.tensor(FP4_VALUES)[codes] * torch.exp2(powers.float())
    weight = values.transpose(1, 2).contiguous()  # experts × in × out, as GptOssExperts holds it
    blocks, scales = to_mxfp4(weight)
    assert blocks.shape == (experts, out, inner // 32, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (experts, out, inner // 32) and scales.dtype == torch.uint8
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), weight)


def test_an_mxfp4_folder_loads_shard_by_shard_dequantized_as_from_pretrained(folders, tmp_path, capsys):
    """GPT-OSS as published (experts as `*_blocks` and `*_scales`, the rest bf16): the meta model
    filled from the files equals from_pretrained(dtype=float32), which dequantizes, bit for bit,
    with no fallback line (today: every rank loads the whole model); a dense model from there
    on, whose save_model folder from_pretrained loads as it is."""
    from hputrain.checkpoint.export import save_model
    from hputrain.recipes import hf

    folder = folders["gpt_oss-mxfp4"]
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in tensor_shapes(folder)
    expected = reference(folder)
    capsys.readouterr()
    state = filled_on_one_process(folder)
    assert "every rank loads the whole model" not in capsys.readouterr().out
    assert_bit_equal(expected, state)
    model, tokenizer = hf.load_model(folder, sharded=True)
    assert getattr(model.config, "quantization_config", None) is None
    from hputrain.distributed.fsdp import materialise, weight_source

    materialise(model, torch.device("cpu"), 0, weight_source(model))
    saved = save_model(model, tmp_path / "final", tokenizer)
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    assert_bit_equal(expected, {k: v.detach() for k, v in loaded.state_dict().items()})


def test_a_part_of_mxfp4_experts_reads_its_experts_and_groups_only(folders, monkeypatch):
    """What a rank asks (expert parallelism's experts 2-4; any box, as fsdp's cut across the
    inputs): only those experts' rows of the blocks and scales, and only the groups of 32 inputs
    the box's columns fall in, equal to from_pretrained's dequantized rows."""
    from hputrain.checkpoint.hf_weights import FolderWeights, read_experts
    from hputrain.recipes.hf.sharded import parameters_on_meta

    folder = folders["gpt_oss-mxfp4"]
    expected = reference(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reads = Reads(monkeypatch)
    key = "model.layers.1.mlp.experts.gate_up_proj"  # experts × 64 inputs (2 groups) × 64
    assert torch.equal(read_experts(folder, model, key, range(2, 5)), expected[key][2:5])
    assert sorted(reads.log) == sorted((f"{key}_{part}", ((e, e + 1), (0, 64), (0, 2)) + tail)
                                       for e in (2, 3, 4) for part, tail in (("blocks", ((0, 16),)), ("scales", ())))
    reads.log.clear()
    source = FolderWeights.match(folder, model)
    box = (slice(5, 7), slice(40, 60), slice(8, 30))  # inputs 40-59: the second group only
    assert torch.equal(source.read_part(key, box), expected[key][box])
    assert sorted(reads.log) == sorted((f"{key}_{part}", ((e, e + 1), (8, 30), (1, 2)) + tail)
                                       for e in (5, 6) for part, tail in (("blocks", ((0, 16),)), ("scales", ())))


def test_a_quantization_it_does_not_dequantize_falls_back_with_its_name(folders, tmp_path):
    """A folder quantized another way (its quantization_config's method): its stored tensors
    are not the weights, so no part is read as stored; the reason names the method, and the
    caller loads the whole model through from_pretrained, as before."""
    from hputrain.checkpoint.hf_weights import FolderWeights
    from hputrain.recipes.hf.sharded import parameters_on_meta

    folder = shutil.copytree(folders["mixtral"], tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(folder), dtype=torch.float32)
    assert FolderWeights.match(folder, model) == (
        "its weights are quantized (fp8), which hputrain does not dequantize part by part")


def assert_each_rank_read_its_experts(out, name: str, folder, ranks: int = 2, experts: int = 8) -> None:
    """Expert parallelism under ddp: each experts tensor of the folder (stored apart, or fused
    along the experts, MXFP4 blocks and scales too) read once across the ranks, each expert by
    the rank that holds it, [r·E/2, (r+1)·E/2); every other tensor read whole by every rank."""
    shapes = tensor_shapes(folder)
    counts = {key: torch.zeros(shape, dtype=torch.int32) for key, shape in shapes.items()}
    for rank in range(ranks):
        mine = range(rank * experts // ranks, (rank + 1) * experts // ranks)
        for entry in json.loads((out / f"{name}.reads.{rank}.json").read_text()):
            counts[entry["key"]][tuple(slice(a, b) for a, b in entry["index"])] += 1
            if ".experts." in entry["key"]:
                apart = re.search(r"experts\.(\d+)\.", entry["key"])
                first, stop = (int(apart.group(1)), int(apart.group(1)) + 1) if apart else entry["index"][0]
                assert mine.start <= first < stop <= mine.stop, (rank, entry)
    for key, count in counts.items():
        assert bool((count == (1 if ".experts." in key else ranks)).all()), key


@pytest.mark.slow
def test_mxfp4_and_ddp_expert_parallelism_load_each_ranks_part_on_two_ranks(tmp_path, folders):
    """On 2 processes: the MXFP4 GPT-OSS folder under fsdp (each byte read once, as any folder),
    and Mixtral and the MXFP4 folder under ddp with expert_parallel_size=2 (issue 47 item 1:
    today every rank loads the whole model and then splits it): equal to from_pretrained, the
    model on the meta device until the strategy, each rank reading its own experts only."""
    mxfp4, mixtral = folders["gpt_oss-mxfp4"], folders["mixtral"]
    launch(tmp_path, f"mxfp4-fsdp,{mxfp4}", f"mixtral-ep-ddp,{mixtral},ep,ddp", f"mxfp4-ep-ddp,{mxfp4},ep,ddp")
    for name, folder in (("mxfp4-fsdp", mxfp4), ("mixtral-ep-ddp", mixtral), ("mxfp4-ep-ddp", mxfp4)):
        assert json.loads((tmp_path / f"{name}.json").read_text())["on_meta"], name
        assert_bit_equal(reference(folder), torch.load(tmp_path / f"{name}.pt"))
        if name.endswith("ddp"):
            assert_each_rank_read_its_experts(tmp_path, name, folder)
        else:
            assert_each_byte_read_once(tmp_path, name, folder)
