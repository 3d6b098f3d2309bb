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
from hputrain.execution.inference import DecodeStep, Generator, bucket_for, wrap_for_inference
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


# -- buckets and the model's maximum length; encoder-decoder models --------------------------------

def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed (hputrain[hf])")


def recording(shapes):
    """A capture that runs the module eagerly and records the shapes of each call's tensors: one
    distinct record is one graph a real capture would compile."""
    def capture(module):
        def run(**inputs):
            shapes.append(tuple(sorted((k, tuple(v.shape)) for k, v in inputs.items()
                                       if isinstance(v, torch.Tensor))))
            return module(**inputs)
        return run
    return capture


def tiny_gpt2(transformers, n_positions=48):
    config = transformers.GPT2Config(vocab_size=64, n_positions=n_positions, n_embd=32, n_layer=1,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def tiny_t5(transformers):
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                   num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


def test_max_length_read_from_configs():
    from hputrain.execution.inference import max_length

    transformers = _transformers()
    assert max_length(tiny_gpt(block_size=40)) == (40, "block_size")
    assert max_length(tiny_gpt2(transformers)) == (48, "n_positions")
    bert = transformers.BertConfig(max_position_embeddings=80)
    assert max_length(type("M", (), {"config": bert})()) == (80, "max_position_embeddings")
    assert max_length(tiny_t5(transformers)) is None  # relative positions: no limit
    assert max_length(torch.nn.Linear(2, 2)) is None


@torch.no_grad()
def test_buckets_stop_at_gpt2_position_table():
    from hputrain.errors import InputError

    transformers = _transformers()
    model, shapes = tiny_gpt2(transformers), []
    graphed = wrap_for_inference(model, CPUAccelerator(), buckets=(32, 64), capture=recording(shapes))
    ids = torch.randint(0, 64, (2, 40))
    out = graphed(input_ids=ids, labels=ids)  # bucket 64 would index past the 48 positions
    reference = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out["logits"], reference.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["loss"], reference.loss, rtol=1e-5, atol=1e-6)
    assert max(dict(s)["input_ids"][1] for s in shapes) == 48
    with pytest.raises(InputError, match=r"49 tokens .* maximum of 48 \(config.n_positions\)") as error:
        graphed(input_ids=torch.randint(0, 64, (2, 49)))
    assert "\n" not in str(error.value)


def test_built_in_gpt_buckets_stop_at_block_size():
    model, shapes = tiny_gpt(block_size=40), []
    graphed = wrap_for_inference(model, CPUAccelerator(), capture=recording(shapes))
    ids = torch.randint(0, 256, (1, 36))
    with torch.no_grad():
        torch.testing.assert_close(graphed(input_ids=ids)["logits"], model(ids)["logits"])
    assert dict(shapes[0])["input_ids"] == (1, 40)


T5_PAIRS = [(10, 3), (14, 7), (9, 12), (12, 5), (30, 20), (7, 9), (16, 16)]  # (source, target) lengths


@torch.no_grad()
def test_t5_decoder_inputs_are_bucketed():
    transformers = _transformers()
    model, shapes = tiny_t5(transformers), []
    graphed = wrap_for_inference(model, CPUAccelerator(), buckets=(8, 16, 32), capture=recording(shapes))
    g = torch.Generator().manual_seed(3)
    for source, target in T5_PAIRS:
        ids = torch.randint(1, 64, (2, source), generator=g)
        labels = torch.randint(1, 64, (2, target), generator=g)
        labels[1, target // 2:] = -100  # a padded row
        out = graphed(input_ids=ids, labels=labels)  # no attention_mask: one is made
        reference = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out["logits"], reference.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["loss"], reference.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["encoder_last_hidden_state"], reference.encoder_last_hidden_state,
                                   rtol=1e-5, atol=1e-5)
    seen = {(dict(s)["input_ids"][1], dict(s)["labels"][1]) for s in shapes}
    # 7 target lengths but only these (source, target) bucket pairs are ever captured
    assert seen == {(16, 8), (16, 16), (32, 32), (8, 16)}


class RecordingCPU(CPUAccelerator):
    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes

    def wrap_graph_inference(self, module):
        return recording(self.shapes)(module)


def test_t5_evaluate_with_graphs_equals_eager(tmp_path):
    transformers = _transformers()
    g = torch.Generator().manual_seed(4)
    rows = [{"input_ids": torch.randint(1, 64, (10 + i % 5,), generator=g),
             "labels": torch.randint(1, 64, (2 + (5 * i) % 13,), generator=g)} for i in range(12)]
    losses, shapes = {}, []
    for graphs in (False, True):
        args = TrainingArguments(output_dir=str(tmp_path), use_graphs_for_inference=graphs,
                                 per_device_eval_batch_size=3, disable_tqdm=True)
        trainer = Trainer(tiny_t5(transformers), args, accelerator=RecordingCPU(shapes))
        losses[graphs] = trainer.evaluate(rows)["eval_loss"]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    # sources of 10..14 and targets of 2..14 tokens, batch 3: one shape, captured once
    assert set(shapes) == {(("attention_mask", (3, 32)), ("input_ids", (3, 32)), ("labels", (3, 32)))}


# -- `hputrain generate`: where the model's shape comes from, hostile checkpoints, bad flags -------

def gpt_config_of(checkpoint):
    """The built-in GPT's config in a checkpoint: config.json, else (older runs) model_config."""
    if (checkpoint / "config.json").is_file():
        return json.loads((checkpoint / "config.json").read_text())
    return json.loads((checkpoint / "trainer_state.json").read_text())["model_config"]


def copy_checkpoint(checkpoint, folder, config=None, legacy=False):
    """A copy of `checkpoint` whose GPT config is `config` (default: its own), written to
    config.json, or with `legacy` only into trainer_state.json's model_config (as runs before
    config.json did)."""
    import shutil

    shutil.copytree(checkpoint, folder)
    config = gpt_config_of(checkpoint) if config is None else config
    state = json.loads((folder / "trainer_state.json").read_text())
    state.pop("model_config", None)
    (folder / "config.json").unlink(missing_ok=True)
    if legacy:
        state["model_config"] = config
    else:
        (folder / "config.json").write_text(json.dumps(config))
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def generate_in_process(capsys, *argv):
    from hputrain.cli import main

    rc = main(["generate", "--cpu", "--no-graphs", *argv])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("legacy", [False, True])
def test_generate_reads_config_json_and_older_model_config(tmp_path, checkpoint, capsys, legacy):
    folder = copy_checkpoint(checkpoint, tmp_path / "ckpt", legacy=legacy)
    rc, captured = generate_in_process(capsys, "--checkpoint", str(folder), "--max-new-tokens", "3",
                                       "--temperature", "0", "--json")
    assert rc == 0, captured.err
    assert json.loads(captured.out)["tokens"] == 3


def test_generate_prefers_config_json(tmp_path, checkpoint, capsys):
    folder = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    state = json.loads((folder / "trainer_state.json").read_text())
    state["model_config"] = {**gpt_config_of(checkpoint), "n_layer": 7}  # stale: config.json wins
    (folder / "trainer_state.json").write_text(json.dumps(state))
    rc, captured = generate_in_process(capsys, "--checkpoint", str(folder), "--max-new-tokens", "2")
    assert rc == 0, captured.err


@pytest.mark.parametrize(("change", "match"), [
    ({"n_layer": 100_000, "n_embd": 1 << 16, "n_head": 64}, "parameters"),
    ({"n_layer": "2"}, "n_layer must be of type int"),
    ({"vocab_size": -1}, "vocab_size must be positive"),
    ({"rope": True}, "no field 'rope'"),
])
@pytest.mark.parametrize("legacy", [False, True])
def test_generate_refuses_bad_configs(tmp_path, checkpoint, capsys, change, match, legacy):
    config = {**gpt_config_of(checkpoint), **change}
    folder = copy_checkpoint(checkpoint, tmp_path / "ckpt", config, legacy=legacy)
    rc, captured = generate_in_process(capsys, "--checkpoint", str(folder))
    assert rc == 2 and captured.err.count("\n") == 1 and match in captured.err
    named = "trainer_state.json" if legacy else "config.json"
    assert f"{folder / named}" in captured.err


@pytest.mark.parametrize("name", ["trainer_state.json", "config.json"])
def test_generate_does_not_hang_on_a_fifo(tmp_path, checkpoint, name):
    folder = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    rc, _, err = hputrain("generate", "--checkpoint", str(folder), "--no-graphs")  # times out if it hangs
    assert rc == 2 and err.count("\n") == 1 and "not a regular file" in err and name in err


@pytest.mark.parametrize(("flags", "named"), [
    (("--temperature", "nan"), "temperature"), (("--temperature", "inf"), "temperature"),
    (("--temperature", "-0.5"), "temperature"), (("--temperature", "1e-45"), "temperature"),
    (("--temperature", "1e-6"), "temperature"), (("--top-k", "0"), "top_k"), (("--top-k", "-3"), "top_k"),
    (("--max-new-tokens", "0"), "--max-new-tokens"), (("--max-new-tokens", "-1"), "--max-new-tokens"),
    (("--seed", str(2**64)), "--seed"),
])
def test_generate_refuses_bad_sampling_flags(checkpoint, capsys, flags, named):
    rc, captured = generate_in_process(capsys, "--checkpoint", str(checkpoint), *flags)
    assert rc == 2 and captured.err.count("\n") == 1 and named in captured.err, captured.err


def test_generate_smallest_temperature_samples(checkpoint, capsys):
    from hputrain.models.gpt import MIN_TEMPERATURE

    rc, captured = generate_in_process(capsys, "--checkpoint", str(checkpoint), "--max-new-tokens", "4",
                                       "--temperature", str(MIN_TEMPERATURE), "--json")
    assert rc == 0, captured.err
    assert json.loads(captured.out)["tokens"] == 4


@pytest.mark.slow
def test_train_evaluates_with_graphs_at_a_length_between_buckets(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(open(os.__file__, "rb").read()[:20_000])
    # 40 bytes used to pad to bucket 64, past the model's 40 positions
    rc, _, err = hputrain("train", "--corpus", str(corpus), "--output-dir", str(tmp_path / "run"),
                          "--max-steps", "2", "--seq-len", "40", "--disable-tqdm", "--eval-steps", "2",
                          "--eval-batches", "1", "--use-graphs-for-inference", "--save-steps", "0")
    assert rc == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in record for record in records)
