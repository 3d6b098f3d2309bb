"""Hugging Face model folders loaded shard by shard under strategy="fsdp", for
tests/recipes/test_sharded_loading.py, started by `hputrain launch` on 2 processes:

    sharded_loading_script.py OUTPUT_DIR CASE [CASE ...]    CASE: NAME,FOLDER[,lora][,ref][,ep][,ddp]

Each case loads FOLDER (a model or adapter folder) as `hputrain train` does under fsdp across
processes (recipes/hf/__init__.py load_model with sharded=True, LoRA r=4 added after torch.manual_seed(0)
with `lora`), lets a Trainer shard and materialise it, and with `ref` places a deep copy of the
starting model as DPO's frozen reference (strategy.place_frozen); with `ep` a mixture of experts'
experts are split over the 2 ranks (expert_parallel_size=2, fsdp on the rest, or ddp with `ddp`)
and the model is gathered with every expert (checkpoint/host.py gathered_state). Every rank records each read of
the weight files (FolderWeights.read: the tensor's name and the rows read) into
OUTPUT_DIR/NAME.reads.RANK.json; global rank 0 writes every tensor of the model (and of the
reference) gathered whole, OUTPUT_DIR/NAME.pt (NAME.ref.pt), and whether the model stayed on the
meta device until the Trainer (NAME.json).
"""
import copy
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain import Trainer, TrainingArguments  # noqa: E402
from hputrain.checkpoint.hf_weights import FolderWeights  # noqa: E402
from hputrain.checkpoint.host import gathered_state  # noqa: E402
from hputrain.recipes import hf  # noqa: E402

READS: list = []
_read = FolderWeights.read


def recording_read(self, key, index):
    """FolderWeights.read, recording what each call read: no rank may read a whole tensor."""
    part = _read(self, key, index)
    READS.append({"key": key, "index": [[s.start, s.stop] for s in index], "shape": list(part.shape)})
    return part


FolderWeights.read = recording_read


def gathered(model) -> dict:
    """Every tensor of the state dict, whole (every rank: full_tensor is a collective)."""
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in model.state_dict().items()}


def run(output_dir: Path, name: str, folder: str, flags: list[str]) -> None:
    READS.clear()
    options = hf.HFOptions(model=folder, dataset="unused", lora_r=4 if "lora" in flags else None)
    torch.manual_seed(0)  # as recipes/hf/__init__.py run: LoRA's adapters are drawn after it
    path = Path(folder)
    if hf.is_adapter_folder(path):
        model, _ = hf.load_model(path, trainable=True, sharded=True)
    else:
        model, _ = hf.load_model(path, sharded=True)
    on_meta = any(p.is_meta for p in model.parameters())
    ref = copy.deepcopy(model) if "ref" in flags else None
    if options.lora_r:
        model = hf.add_lora(model, options)
    if "ep" in flags:
        from hputrain.kinds.moe.experts.parallel import register

        register()  # the expert-parallel forward, as the recipes register it
    args = TrainingArguments(output_dir=str(output_dir / name), max_steps=1, disable_tqdm=True,
                             accelerator="cpu", strategy="ddp" if "ddp" in flags else "fsdp",
                             ddp_timeout=60, report_to="none",
                             expert_parallel_size=2 if "ep" in flags else 1)
    ids = torch.arange(8).reshape(1, 8)
    trainer = Trainer(model, args, train_dataset=[{"input_ids": ids[0], "labels": ids[0]}])
    state = gathered_state(trainer.model) if "ep" in flags else gathered(trainer.model)
    ref_state = gathered(trainer.strategy.place_frozen(ref, trainer.device)) if ref is not None else None
    rank = trainer.group.rank
    (output_dir / f"{name}.reads.{rank}.json").write_text(json.dumps(READS))
    if trainer.group.is_main:
        torch.save(state, output_dir / f"{name}.pt")
        if ref_state is not None:
            torch.save(ref_state, output_dir / f"{name}.ref.pt")
        (output_dir / f"{name}.json").write_text(json.dumps({"on_meta": on_meta}))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        case_name, case_folder, *case_flags = case.split(",")
        run(out, case_name, case_folder, case_flags)
