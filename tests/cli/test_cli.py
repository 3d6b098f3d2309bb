"""The command line as a user meets it: output, exit codes, one-line errors; import hygiene."""
import json
import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from hputrain.cli import main

from ..hf_fixtures import llama_folder  # noqa: F401


def run_cli(*argv, env=None):
    """Run `hputrain ...` in a fresh interpreter (as a user would), return (rc, stdout, stderr)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HPUTRAIN_ACCELERATOR", None) if not (env or {}).get("HPUTRAIN_ACCELERATOR") else None
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", *argv], capture_output=True,
                          text=True, env=full_env, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_env_json():
    rc, out, err = run_cli("env", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert {"accelerator", "device_count", "available", "torch", "hputrain", "env"} <= set(report)
    assert report["torch"] == torch.__version__
    assert report["available"]["cpu"] == 1
    assert report["accelerator"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_env_reports_forcing_variable():
    rc, out, _ = run_cli("env", "--json", env={"HPUTRAIN_ACCELERATOR": "cpu"})
    report = json.loads(out)
    assert rc == 0 and report["accelerator"] == "cpu" and report["env"]["HPUTRAIN_ACCELERATOR"] == "cpu"


def test_env_cpu_flag(capsys):
    assert main(["env", "--cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["accelerator"] == "cpu" and report["native_fp8"] is False  # fp8 is emulated here
    os.environ.pop("HPUTRAIN_ACCELERATOR", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_absent_accelerator_is_one_line_and_exit_2():
    rc, out, err = run_cli("env", "--accelerator", "cuda")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "'cuda'" in err and "found: cpu" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["env", "--jsn"], ["unrecognized arguments: --jsn", "did you mean --json"]),
    (["bogus"], ["invalid choice"]),
    ([], ["required"]),
])
def test_usage_errors_are_one_line(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hputrain: error:")
    assert all(w in err for w in words)


def test_import_runs_nothing():
    """`import hputrain` imports no vendor runtime, starts no subprocess and patches nothing."""
    code = r"""
import sys
events = []
sys.addaudithook(lambda event, args: events.append(event)
                 if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork") else None)
import torch
gather, mark = torch.gather, set(sys.modules)
import hputrain
assert not events, events
assert torch.gather is gather
vendor = [m for m in sys.modules if m.startswith(("habana_frameworks", "transformers", "lightning", "accelerate"))]
assert not vendor, vendor
print("clean", len(set(sys.modules) - mark))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("clean")


# -- generate --model DIR --chat QUESTION (issue 24) --------------------------------------------

CHATML = os.path.join(str(Path(__file__).parents[1]), "chat_templates", "chatml.jinja")
QUESTION = "what does the quick brown fox do?"


def _save_chat_llama(folder, stop_after: int | None = None):
    """A tiny Llama whose tokenizer carries ChatML. With `stop_after` k, <|im_end|>'s output row is
    the row of the token greedy decoding picks k-th, scaled up: the model ends its turn there."""
    transformers = pytest.importorskip("transformers")
    from ..hf_fixtures import tiny_llama_config, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    with open(CHATML) as handle:
        tokenizer.chat_template = handle.read()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(len(tokenizer))).eval()
    if stop_after is not None:
        ids = _chat_ids(tokenizer)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=stop_after, do_sample=False, eos_token_id=[])
            head = model.get_output_embeddings().weight
            head[tokenizer.convert_tokens_to_ids("<|im_end|>")] = 10 * head[out[0, -1]]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _chat_ids(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                         add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def chat_llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-llamas")
    return _save_chat_llama(root / "plain"), _save_chat_llama(root / "stops", stop_after=4)


def _generate_chat(capsys, folder, *extra) -> dict:
    assert main(["generate", "--cpu", "--model", str(folder), "--chat", QUESTION, "--json",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _reference_answer(folder, max_new_tokens: int):
    """transformers' own greedy generate on the rendered question, stopping at eos and
    <|im_end|>: (new token ids, the answer's text)."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = _chat_ids(tokenizer)
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True).strip()


def test_generate_chat_answers_as_transformers_generate_does(capsys, chat_llamas):
    folder = chat_llamas[0]
    answer = _generate_chat(capsys, folder, "--max-new-tokens", "12")
    new, text = _reference_answer(folder, 12)
    assert answer["text"] == text and answer["tokens"] == len(new) == 12 and text
    assert answer["stop_token_ids"] == [2, 301]  # </s>, then ChatML's <|im_end|>
    # without --json: the answer alone on stdout
    assert main(["generate", "--cpu", "--model", str(folder), "--chat", QUESTION,
                 "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_generate_chat_stops_at_the_end_of_the_turn(capsys, chat_llamas):
    folder = chat_llamas[1]  # emits <|im_end|> as its 4th token or before
    answer = _generate_chat(capsys, folder, "--max-new-tokens", "20")
    new, text = _reference_answer(folder, 20)
    assert new[-1] == 301 and len(new) <= 4  # the turn ended, well before 20 tokens
    assert answer["text"] == text and answer["tokens"] == len(new)
    assert "<|im_end|>" not in answer["text"]


@pytest.mark.parametrize("argv, words", [
    (["--model", "{tmp}/nowhere", "--chat", "hi"], "is not a folder"),
    (["--model", "{plain}", "--chat", "hi"], "no chat template"),
    (["--model", "{chat}"], "--model needs --chat"),
    (["--checkpoint", "{tmp}", "--chat", "hi"], "--chat needs --model"),
    (["--model", "{chat}", "--checkpoint", "{tmp}", "--chat", "hi"], "not both"),
    ([], "generate needs --checkpoint"),
], ids=["missing-folder", "no-template", "no-question", "chat-without-model", "both", "neither"])
def test_generate_chat_bad_input_is_one_line(tmp_path, capsys, chat_llamas,
                                             llama_folder, argv, words):  # noqa: F811
    names = {"tmp": tmp_path, "plain": llama_folder, "chat": chat_llamas[0]}
    assert main(["generate", "--cpu", *(a.format(**names) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err
