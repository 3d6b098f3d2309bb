"""Graph-captured inference and generation: the KV cache against full recomputation, graphs
against eager, one capture per length bucket, predict() with graphs, and `hputrain generate`."""
import json
import os
import subprocess
import sys

import pytest
import torch

from hputrain import Trainer, TrainingArguments
from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.inference import DecodeStep, Generator, bucket_for, wrap_for_inference
from hputrain.models.gpt import GPT, GPTConfig


def tiny_gpt(block_size=64):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size)).eval()


PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [42] * 11]


def counting(counter):
    """A capture that compiles with dynamo (no code generation) and counts the graphs."""
    return lambda module: torch.compile(module, backend=counter, dynamic=False)


def test_buckets():
    assert [bucket_for(n, (32, 64)) for n in (1, 32, 33, 64, 65, 130)] == [32, 32, 64, 64, 128, 192]


@torch.no_grad()
def test_kv_cache_decoding_equals_full_recomputation():
    model = tiny_gpt()
    step = DecodeStep(model, 1, 64)
    sequence = torch.tensor([[5, 17, 99, 3, 250, 8, 8, 1]])
    full = model(sequence)["logits"][0]
    for t in range(sequence.shape[1]):  # one token a call, as decoding does
        logits = step(sequence[:, t:t + 1], torch.tensor([[t]]), torch.tensor([0]))
        torch.testing.assert_close(logits[0], full[t], rtol=1e-5, atol=1e-5)
    generator = Generator(model, CPUAccelerator(), graphs=False)
    result = generator.generate(PROMPTS, 12)
    for prompt, new in zip(PROMPTS, result.tokens):
        expected = model.generate(torch.tensor([prompt]), 12, temperature=0.0)[0, len(prompt):]
        assert new == expected.tolist()


def test_sampling_respects_top_k():
    model = tiny_gpt()
    torch.manual_seed(1)
    result = Generator(model, CPUAccelerator(), graphs=False).generate([[3, 4]], 20, temperature=1.0, top_k=1)
    greedy = Generator(model, CPUAccelerator(), graphs=False).generate([[3, 4]], 20)
    assert result.tokens == greedy.tokens  # top-1 sampling is greedy


def test_one_capture_per_bucket():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = tiny_gpt()
    graphed = wrap_for_inference(model, CPUAccelerator(), buckets=(32, 64), capture=counting(counter))
    for length in (20, 30, 50, 64, 7):
        ids = torch.randint(0, 256, (2, length))
        out = graphed(input_ids=ids, labels=ids)
        reference = model(ids, labels=ids)
        torch.testing.assert_close(out["logits"], reference["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["loss"], reference["loss"], rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 2  # lengths 20, 30, 7 share bucket 32; 50 and 64 share 64


def test_decode_step_is_captured_once():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    generator = Generator(tiny_gpt(), CPUAccelerator(), buckets=(16, 32), capture=counting(counter))
    graphed = generator.generate(PROMPTS, 10)
    assert counter.frame_count == 2  # the prompts' bucket (16) and the one-token decode step
    generator.generate(PROMPTS, 4)
    assert counter.frame_count == 2  # nothing new for the same batch and bucket
    generator.generate([[1, 2]], 5)
    assert counter.frame_count == 4  # batch 1 is a new step: its bucket and its decode
    eager = Generator(tiny_gpt(), CPUAccelerator(), graphs=False).generate(PROMPTS, 10)
    assert graphed.tokens == eager.tokens


def test_hpu_graphs_for_generation(fake_hpu):
    from hputrain.accelerators.hpu import HPUAccelerator

    Generator(tiny_gpt(), HPUAccelerator("lazy"))._step(2)
    assert ("wrap_in_hpu_graph", "DecodeStep") in fake_hpu.calls


@pytest.mark.slow
@pytest.mark.ci
def test_greedy_text_with_graphs_equals_text_without():
    model = tiny_gpt()
    graphed = Generator(model, CPUAccelerator(), graphs=True).generate(PROMPTS, 16)
    eager = Generator(model, CPUAccelerator(), graphs=False).generate(PROMPTS, 16)
    assert graphed.tokens == eager.tokens


def token_rows(n=24, seq=32):
    g = torch.Generator().manual_seed(2)
    t = torch.randint(0, 256, (n, seq + 1), generator=g)
    return [{"input_ids": r[:-1], "labels": r[1:]} for r in t]


class CountingCPU(CPUAccelerator):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def wrap_graph_inference(self, module):
        return counting(self.counter)(module)


def test_predict_and_evaluate_with_graphs_equal_eager(tmp_path):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    data = token_rows()
    runs = {}
    for graphs in (False, True):
        args = TrainingArguments(output_dir=str(tmp_path), use_graphs_for_inference=graphs,
                                 per_device_eval_batch_size=5, disable_tqdm=True)
        trainer = Trainer(tiny_gpt(), args, accelerator=CountingCPU(counter))
        runs[graphs] = (trainer.predict(data), trainer.evaluate(data))
    (eager_pred, eager_eval), (graph_pred, graph_eval) = runs[False], runs[True]
    torch.testing.assert_close(graph_pred.predictions, eager_pred.predictions, rtol=1e-5, atol=1e-5)
    assert graph_eval["eval_loss"] == pytest.approx(eager_eval["eval_loss"], rel=1e-6)
    assert counter.frame_count == 2  # batches of 5 and the last of 4: each padded to bucket 32


def hputrain(*argv):
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HPUTRAIN_ACCELERATOR": "cpu"})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    corpus = out / "corpus.txt"
    corpus.write_bytes(open(os.__file__, "rb").read()[:40_000])
    rc, _, err = hputrain("train", "--corpus", str(corpus), "--output-dir", str(out), "--max-steps", "3",
                          "--seq-len", "32", "--disable-tqdm", "--eval-steps", "0")
    assert rc == 0, err
    return out / "checkpoint-3"


def test_generate_json(checkpoint):
    rc, out, err = hputrain("generate", "--checkpoint", str(checkpoint), "--prompt", "def ", "--prompt", "x",
                            "--max-new-tokens", "5", "--temperature", "0", "--json", "--no-graphs")
    assert rc == 0, err
    records = json.loads(out)
    assert len(records) == 2 and records[0]["text"].startswith("def ")
    assert {"text", "tokens", "tokens_per_second", "time_to_first_token_ms"} <= set(records[0])
    assert records[0]["tokens"] == 5


def test_generate_bad_checkpoints(tmp_path, checkpoint):
    rc, _, err = hputrain("generate", "--checkpoint", str(tmp_path / "nope"))
    assert rc == 2 and err.count("\n") == 1 and "nope" in err
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"garbage")
    rc, _, err = hputrain("generate", "--checkpoint", str(broken), "--no-graphs")
    assert rc == 2 and err.count("\n") == 1 and "model.safetensors" in err
