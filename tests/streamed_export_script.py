"""Under `hputrain launch`, 2 processes: a tiny untied Llama sharded by hputrain's fsdp, written
whole by rank 0 twice (export.save_model into OUTPUT/final, ShardedState.consolidate into
OUTPUT/model.safetensors), each while a dispatch mode counts the bytes of tensor storage alive
on this rank that the write made, and the bytes it asked to copy to its host (every rank
writes OUTPUT/host_copies_rankR.json: {"final": bytes, "consolidate": bytes}). Rank 0 writes
OUTPUT/peaks.json ({"final": bytes, "consolidate": bytes, "model": bytes of the whole model,
"largest": bytes of its largest tensor}) and OUTPUT/expected.pt (the weights, gathered by
torch's full state dict).

    streamed_export_script.py OUTPUT_DIR [--max-shard-size N]
"""
import argparse
import json
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain import Trainer, TrainingArguments  # noqa: E402
from hputrain.checkpoint import export  # noqa: E402
from hputrain.checkpoint.sharded import ShardedState  # noqa: E402
from tests.dist_script import data  # noqa: E402


def _pointer(tensor):
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a storage with no data of its own (a tensor subclass's)
        return None


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those made inside it."""

    def __init__(self):
        super().__init__()
        self.alive, self.peak, self.seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view of an input (a shard the model holds) is not memory the write made
        inputs = {_pointer(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in (out if isinstance(out, (list, tuple)) else [out]):
            if (isinstance(tensor, torch.Tensor) and not hasattr(tensor, "device_mesh")
                    and not tensor.is_meta and _pointer(tensor) not in inputs):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage):
        try:
            key = storage.data_ptr()
        except RuntimeError:  # a storage with no data of its own (a tensor subclass's)
            return
        if key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        self.alive += storage.nbytes()
        self.peak = max(self.peak, self.alive)
        weakref.finalize(storage, self._freed, key, storage.nbytes())

    def _freed(self, key, nbytes):
        self.seen.discard(key)
        self.alive -= nbytes


class HostCopies:
    """The bytes of the tensors this rank asks to copy to its host (`Tensor.cpu`) inside it: on a
    device each is a copy; on the CPU the call is one still (a no-op there)."""

    def __enter__(self):
        self.bytes, self._cpu = 0, torch.Tensor.cpu
        copies = self

        def cpu(tensor, *args, **kwargs):
            copies.bytes += tensor.numel() * tensor.element_size()
            return copies._cpu(tensor, *args, **kwargs)

        torch.Tensor.cpu = cpu
        return self

    def __exit__(self, *exc):
        torch.Tensor.cpu = self._cpu


def main():
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("--max-shard-size", type=int, default=5 * 2**30)
    opts = p.parse_args()
    import transformers

    from tests.hf_fixtures import tiny_llama_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(256, num_hidden_layers=4))
    args = TrainingArguments(output_dir=opts.output_dir, max_steps=1, per_device_train_batch_size=2,
                             save_steps=-1, disable_tqdm=True, accelerator="cpu", strategy="fsdp",
                             ddp_timeout=60, report_to="none", throughput_warmup_steps=0)
    trainer = Trainer(model, args, train_dataset=data(8))
    trainer.train()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    expected = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    peaks, copied = {}, {}
    with LiveBytes() as counted, HostCopies() as host:
        export.save_model(model, os.path.join(opts.output_dir, "final"), group=trainer.group,
                          max_shard_size=opts.max_shard_size)
    peaks["final"], copied["final"] = counted.peak, host.bytes
    with LiveBytes() as counted, HostCopies() as host:
        ShardedState().consolidate(os.path.join(opts.output_dir, "model.safetensors"), model=model,
                                   rank=trainer.group.rank)
    peaks["consolidate"], copied["consolidate"] = counted.peak, host.bytes
    with open(os.path.join(opts.output_dir, f"host_copies_rank{trainer.group.rank}.json"), "w") as f:
        json.dump(copied, f)
    if trainer.group.is_main:
        sizes = [t.numel() * t.element_size() for t in expected.values()]
        peaks |= {"model": sum(sizes), "largest": max(sizes)}
        with open(os.path.join(opts.output_dir, "peaks.json"), "w") as f:
            json.dump(peaks, f)
        torch.save(expected, os.path.join(opts.output_dir, "expected.pt"))


if __name__ == "__main__":
    main()
