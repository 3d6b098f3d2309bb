"""A full disk, made deterministic: every save path of hputrain written under a file size limit
(RLIMIT_FSIZE, with SIGXFSZ ignored, so that a write past the limit fails with EFBIG, "File too
large", as a write to a full disk fails with ENOSPC). Each case first saves without the limit,
then saves again under a limit that the file it targets passes and every file written before it
does not; it reports what was raised and what the earlier save left. Prints one JSON object:
{case: {"error": type name, "message": str, "earlier_whole": bool, "left": [names]}}.

    full_disk_script.py OUTPUT_DIR torch|hf [LLAMA_FOLDER]

`torch`: checkpoints of the built-in GPT (rng_state_0.pt and optimizer.pt through torch.save's
zip writer, model.safetensors through safetensors), a sharded (DCP) checkpoint, final/ of the
GPT, and the streamed writer. `hf`: final/ of a transformers Llama with its tokenizer
(save_pretrained's safetensors and JSON writes, the tokenizer's Rust writer) and of a PEFT LoRA.
"""
import hashlib
import json
import resource
import shutil
import signal
import sys
from pathlib import Path

import torch

OUT = Path(sys.argv[1])


def limited(limit: int | None) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit or resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def attempt(save, limit: int, earlier: Path, root: Path) -> dict:
    """`save()` under `limit`; what it raised, whether `earlier` is unchanged, what `root` holds."""
    before = digest(earlier)
    limited(limit)
    try:
        save()
        error, message = None, ""
    except BaseException as exc:  # noqa: BLE001 - reported (DCP raises a BaseException)
        error, message = type(exc).__name__, str(exc)
    finally:
        limited(None)
    return {"error": error, "message": message, "earlier_whole": digest(earlier) == before,
            "left": sorted(p.name for p in root.iterdir())}


def limit_for(sizes: dict[str, int], order: list[str], target: str) -> int:
    """A limit that every file written before `target` passes and `target` meets halfway or
    more: inside torch.save's own writes, not at the flush after it, which a limit at the last
    byte would meet (torch's zip writer raises RuntimeError, the flush an OSError)."""
    before = max((sizes[name] for name in order[:order.index(target)]), default=0)
    assert before < sizes[target] // 2, (sizes, target)
    return max(before + 1, sizes[target] // 2)


def torch_cases() -> dict:
    from hputrain.checkpoint import export
    from hputrain.checkpoint.saving import load_checkpoint, save_checkpoint
    from hputrain.checkpoint.sharded import ShardedState
    from hputrain.checkpoint.streamed import write_safetensors
    from hputrain.models.gpt import GPT, GPTConfig

    def layers():  # tensors of 1 MiB: torch.save writes each past Python's buffer, as a model's
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.Linear(512, 512))

    model = layers()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 512)).sum().backward()
    optimizer.step()
    results = {}

    def save(out, step, **kwargs):
        return save_checkpoint(out, step, model=model, optimizer=optimizer, scheduler=None,
                               state={"epoch": 0}, accelerator=None, **kwargs)

    out = OUT / "full"
    first = save(out, 1)
    sizes = {p.name: p.stat().st_size for p in first.iterdir()}
    order = ["rng_state_0.pt", "model.safetensors", "optimizer.pt"]  # save_checkpoint's order
    for target in order:
        results[f"checkpoint {target}"] = attempt(lambda: save(out, 2), limit_for(sizes, order, target),
                                                  first, out)
    fresh = layers()
    load_checkpoint(first, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    results["earlier loads"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))

    out = OUT / "sharded"
    first = save(out, 1, state_io=ShardedState())
    shard = max(p.stat().st_size for p in (first / "sharded").glob("*.distcp"))
    results["checkpoint sharded"] = attempt(lambda: save(out, 2, state_io=ShardedState()), shard - 1,
                                            first, out)

    out = OUT / "gpt"
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16))
    final = export.save_model(gpt, out / "final")
    size = (final / "model.safetensors").stat().st_size
    results["final gpt"] = attempt(lambda: export.save_model(gpt, out / "final"), size - 1, final, out)

    out = OUT / "streamed"
    out.mkdir()
    entries = dict(model.state_dict())
    write_safetensors(out / "whole.safetensors", entries)
    size = (out / "whole.safetensors").stat().st_size
    results["streamed"] = attempt(lambda: write_safetensors(out / "model.safetensors", entries),
                                  size // 2, out / "whole.safetensors", out)
    return results


def hf_cases(llama: Path) -> dict:
    import warnings

    import peft
    import transformers

    from hputrain.checkpoint import export

    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    results, out = {}, OUT / "llama"
    final = export.save_model(model, out / "final", tokenizer)
    sizes = {p.name: p.stat().st_size for p in final.iterdir()}
    for target, limit in (("model.safetensors", sizes["model.safetensors"] - 1),
                          ("config.json", sizes["config.json"] - 1)):
        results[f"final {target}"] = attempt(lambda: export.save_model(model, out / "final", tokenizer),
                                             limit, final, out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
        out = OUT / "lora"
        final = export.save_model(lora, out / "final", tokenizer)
        sizes = {p.name: p.stat().st_size for p in final.iterdir()}
        assert sizes["tokenizer.json"] > max(size for name, size in sizes.items() if name != "tokenizer.json")
        results["final tokenizer.json"] = attempt(lambda: export.save_model(lora, out / "final", tokenizer),
                                                  sizes["tokenizer.json"] - 1, final, out)
    return results


if __name__ == "__main__":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, EFBIG
    cases = torch_cases() if sys.argv[2] == "torch" else hf_cases(Path(sys.argv[3]))
    print(json.dumps(cases))
    shutil.rmtree(OUT, ignore_errors=True)
