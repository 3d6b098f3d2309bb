"""A tiny mixture-of-experts folder (experts stored apart, as on the Hub) trained 2 steps under
hputrain's fsdp on 2 processes, then written to OUTPUT_DIR/final by export.save_model, for
tests/kinds/moe/test_moe_loading.py, started by `hputrain launch`:

    moe_export_script.py OUTPUT_DIR FOLDER

The model is loaded as `hputrain train` loads it under fsdp across processes (recipes/hf/__init__.py
load_model with sharded=True: each rank reads its own experts). Global rank 0 writes
OUTPUT_DIR/trained.pt: the trained model's logits on a fixed batch (its weights gathered whole
into an eager copy of the model) and the weights themselves, which from_pretrained(final) must
give back, and OUTPUT_DIR/peaks.json: the most bytes of tensor storage the write made alive at
once on rank 0 ("final"), beside the whole model's bytes and its largest tensor's.
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain import Trainer, TrainingArguments  # noqa: E402
from hputrain.checkpoint import export  # noqa: E402
from hputrain.recipes import hf  # noqa: E402
from tests.streamed_export_script import LiveBytes  # noqa: E402

BATCH = torch.arange(2, 34).reshape(2, 16)


def rows(n=8, seq=16):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(4, 250, (n, seq), generator=g)
    return [{"input_ids": t, "labels": t} for t in tokens]


def main(output_dir: Path, folder: Path) -> None:
    import transformers

    model, _ = hf.load_model(folder, sharded=True)
    assert all(p.is_meta for p in model.parameters()), "the folder was loaded whole"
    args = TrainingArguments(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-2, save_steps=-1, disable_tqdm=True, accelerator="cpu",
                             strategy="fsdp", ddp_timeout=60, report_to="none")
    trainer = Trainer(model, args, train_dataset=rows())
    trainer.train()
    state = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
             for name, t in trainer.model.state_dict().items()}
    with LiveBytes() as counted:  # what the write made alive at once on this rank
        export.save_model(trainer.model, output_dir / "final", group=trainer.group)
    if trainer.group.is_main:
        sizes = [t.numel() * t.element_size() for t in state.values()]
        peaks = {"final": counted.peak, "model": sum(sizes), "largest": max(sizes)}
        (output_dir / "peaks.json").write_text(json.dumps(peaks))
        eager = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(folder), dtype=torch.float32)
        eager.load_state_dict(state)
        with torch.no_grad():
            logits = eager.eval()(input_ids=BATCH).logits
        torch.save({"logits": logits, "state": state}, output_dir / "trained.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
