"""Each rank of tests/methods/dpo/test_dpo_precompute.py's 2-process case:
`hputrain launch --nproc-per-node 2 --cpu THIS POLICY REFERENCE OUT STRATEGY`.

On 10 pairs in batches of 2 (5 batches), through DPOTrainer as a user's script calls it:
1. train one step with a precomputed reference: this rank's reference batches and log-probs,
   and whether the frozen reference was freed;
2. the same pairs again with a trainer whose rank 1 cannot see the cache rank 0 sees (its read
   forced to find nothing), then whose rank 0 cannot: both ranks must agree to run the pass,
   not deadlock;
3. once more, nothing forced: every rank reads the cache.
Each rank writes what it saw to OUT/rank{R}.json."""
from __future__ import annotations

import gc
import json
import os
import sys
import weakref
from pathlib import Path


def main(policy: str, reference: str, out: str, strategy: str) -> int:
    import transformers

    from hputrain.methods.dpo.config import DPOConfig
    from hputrain.methods.dpo.data import encode_pairs
    from hputrain.methods.dpo import trainer as dpo

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.methods.dpo.test_dpo import text_rows

    rank = int(os.environ["RANK"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(policy)
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(text_rows(10))), tokenizer,
                            max_length=128)

    def trainer():
        args = DPOConfig(output_dir=str(Path(out) / "run"), precompute_ref_log_probs=True,
                         max_steps=1, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                         report_to="none", disable_tqdm=True, max_length=128, save_steps=-1,
                         devices=2, strategy=strategy, ddp_timeout=60)
        load = transformers.AutoModelForCausalLM.from_pretrained
        return dpo.DPOTrainer(load(policy), args, ref_model=load(reference),
                              processing_class=tokenizer, train_dataset=pairs)

    seen = {}
    first = trainer()
    probe = weakref.ref(first.objective.reference)
    first.train()
    gc.collect()
    seen["trained"] = {"forwards": first.precompute_forwards, "freed": probe() is None,
                       "ref_logps": logps_of(first.train_dataset)}

    forced, counted = trainer(), 0
    for blind in (1, 0, None):  # rank 1, then rank 0 (the writer), finds no cache; then neither
        read = dpo._read_logps
        if rank == blind:  # this rank finds no cache where the other finds one
            dpo._read_logps = lambda path, count: None
        try:
            with_ref = forced.precompute_reference(pairs)
        finally:
            dpo._read_logps = read
        seen[f"blind {blind}"] = {"forwards": forced.precompute_forwards - counted,
                                  "ref_logps": logps_of(with_ref)}
        counted = forced.precompute_forwards
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    return 0


def logps_of(pairs) -> list:
    """Each pair's reference log-probs as the collator reads them (chosen, rejected)."""
    from hputrain.methods.dpo.data import REF_KEYS

    return [[pair[REF_KEYS[0]], pair[REF_KEYS[1]]] for pair in pairs]


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
