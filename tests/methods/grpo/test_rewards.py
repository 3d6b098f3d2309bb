"""Issue 32: reward functions with TRL 1.16's signature and reward-model rewards. The reference is
TRL's own GRPOTrainer._calculate_rewards, called on a stand-in trainer that holds only what that
method reads, with the same functions, models, prompts and completions."""
from __future__ import annotations

import collections
import json
import math
import types
from pathlib import Path

import pytest
import torch

from ...hf_fixtures import tiny_llama_config, tiny_llama_folder, tiny_tokenizer

transformers = pytest.importorskip("transformers", reason="reward models are Hugging Face models")

from hputrain.errors import InputError  # noqa: E402
from hputrain.methods.grpo.rewards import (CompletionsLog, RewardFunctions, completion_for,
                                           conversational, per_completion_columns)

TEMPLATES = Path(__file__).parents[2] / "chat_templates"
PROMPTS = ["the quick brown", "to be or", "a stitch in time"]
TEXTS = [" fox jumps", " lazy dog", " not to be", "4", " saves nine", " is a penny earned and more"]
ROWS = [{"prompt": p, "answer": a, "level": i} for i, (p, a) in enumerate(zip(PROMPTS, ["fox", "4", "nine"]))]
G = 2  # completions per prompt


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    """A tiny Llama sequence classifier with one label, saved with a tokenizer that has a chat
    template (ChatML) and adds <s> unless told not to, as a user's reward-model folder."""
    folder = tmp_path_factory.mktemp("reward-model") / "tiny-rm"
    from tokenizers import processors

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (TEMPLATES / "chatml.jinja").read_text()
    # A tokenizer that adds <s> when asked to: TRL asks it not to, and so must we.
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(
        tiny_llama_config(len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def batch(chat: bool = False):
    """(prompts, completions, completion_ids, TRL's inputs, our columns): G completions per prompt."""
    prompts = [p for p in PROMPTS for _ in range(G)]
    if chat:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    completions = [completion_for(p, text) for p, text in zip(prompts, TEXTS)]
    completion_ids = [list(range(1, len(text) + 1)) for text in TEXTS]
    inputs = [dict(row, prompt=p) for row, p in zip([r for r in ROWS for _ in range(G)], prompts)]
    return prompts, completions, completion_ids, inputs, per_completion_columns(ROWS, G)


def trl_rewards(rewards: RewardFunctions, inputs, prompts, completions, completion_ids, step: int):
    """TRL 1.16's _calculate_rewards on the same functions, and the stand-in trainer (its logs)."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

    class Stub(trl_grpo.GRPOTrainer):  # the method calls super(), which needs a GRPOTrainer
        pass

    cpu = torch.device("cpu")
    stub = object.__new__(Stub)  # no __init__: only the attributes _calculate_rewards reads
    stub.__dict__.update(
        reward_funcs=rewards.functions, reward_processing_classes=rewards.tokenizers,
        reward_func_names=rewards.names, environments=None, chat_template_kwargs={},
        accelerator=types.SimpleNamespace(device=cpu, is_main_process=True),
        args=types.SimpleNamespace(report_to=[], device=cpu), is_deepspeed_enabled=False,
        state=types.SimpleNamespace(global_step=step),
        _pending_extra_logs=collections.defaultdict(list), _pending_metrics=collections.defaultdict(list))
    return trl_grpo.GRPOTrainer._calculate_rewards(stub, inputs, prompts, completions, completion_ids), stub


def write_reward_file(tmp_path: Path, body: str, name: str = "my_rewards.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


REWARD_FILE = '''
import math

def exact(completions, answer, **kwargs):
    """1 where the completion is the answer; None where the answer is "4" (no opinion)."""
    return [None if a == "4" else float(c.strip().endswith(a)) for c, a in zip(completions, answer)]

def length(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, level, **kwargs):
    log_extra("level_seen", list(level))
    log_metric("mean_ids", sum(map(len, completion_ids)) / len(completion_ids))
    return [len(ids) * 0.1 + trainer_state.global_step + lv for ids, lv in zip(completion_ids, level)]

def plain(completions, answer):
    return [float(a in c) for c, a in zip(completions, answer)]

NOT_A_FUNCTION = 3
'''


# -- functions -------------------------------------------------------------------------------------

def test_functions_from_a_file_get_the_columns_per_completion_and_equal_trl(tmp_path):
    path = write_reward_file(tmp_path, REWARD_FILE)
    rewards = RewardFunctions([f"{path}:exact", f"{path}:length"], weights=[1.0, 0.5])
    assert rewards.names == ["exact", "length"]
    assert rewards.weights.tolist() == [1.0, 0.5]
    prompts, completions, ids, inputs, columns = batch()
    assert columns["answer"] == ["fox", "fox", "4", "4", "nine", "nine"]  # TRL's order
    ours = rewards(prompts, completions, ids, columns, step=7)
    assert ours.dtype == torch.float32 and ours.shape == (6, 2)
    assert ours[:, 0].tolist()[:2] == [0.0, 0.0] and ours[4, 0] == 1.0
    assert ours[2:4, 0].isnan().all()  # None -> NaN
    assert ours[:, 1].tolist() == pytest.approx([len(i) * 0.1 + 7 + r["level"]
                                                 for i, r in zip(ids, inputs)])
    theirs, stub = trl_rewards(rewards, inputs, prompts, completions, ids, step=7)
    torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)
    extra, metrics = rewards.take_logs()
    assert extra == dict(stub._pending_extra_logs) == {"level_seen": [0, 0, 1, 1, 2, 2]}
    assert metrics == dict(stub._pending_metrics)
    assert rewards.take_logs() == ({}, {})


def test_values_convert_as_trl_converts_them():
    """bools, ints, numpy and 0-d torch values, a tensor as the whole answer, an async function."""
    np = pytest.importorskip("numpy")

    def mixed(completions, **kwargs):
        return [True, 2, np.float32(0.25), torch.tensor(-1.5), None, False]

    def as_tensor(completions, **kwargs):
        return torch.arange(len(completions), dtype=torch.float64) / 3

    async def later(completions, **kwargs):
        return [0.5] * len(completions)

    rewards = RewardFunctions([mixed, as_tensor, later])
    prompts, completions, ids, inputs, columns = batch()
    ours = rewards(prompts, completions, ids, columns, step=0)
    assert ours[:, 0].tolist()[:4] == [1.0, 2.0, 0.25, -1.5] and ours[5, 0] == 0.0
    theirs, _ = trl_rewards(RewardFunctions([mixed, as_tensor]), inputs, prompts, completions, ids, 0)
    torch.testing.assert_close(ours[:, :2], theirs, equal_nan=True, rtol=0, atol=0)
    assert ours[:, 2].tolist() == [0.5] * 6


def test_a_function_without_kwargs_gets_only_what_it_names(tmp_path):
    path = write_reward_file(tmp_path, REWARD_FILE)
    rewards = RewardFunctions([f"{path}:plain"])
    prompts, completions, ids, _, columns = batch()
    assert rewards(prompts, completions, ids, columns, 1)[:, 0].tolist() == [1, 0, 0, 1, 1, 0]


def test_conversational_prompts_get_trl_completions():
    prompt = [{"role": "user", "content": "hi"}]
    assert conversational(prompt) and not conversational("hi") and not conversational([])
    assert completion_for(prompt, "yo") == [{"role": "assistant", "content": "yo"}]
    assert completion_for("hi", "yo") == "yo"
    seen = {}

    def contents(completions, **kwargs):
        seen["completions"] = completions
        return [len(c[0]["content"]) for c in completions]

    prompts, completions, ids, _, columns = batch(chat=True)
    out = RewardFunctions(contents)(prompts, completions, ids, columns, 0)
    assert out[:, 0].tolist() == [len(t) for t in TEXTS]
    assert seen["completions"][0] == [{"role": "assistant", "content": TEXTS[0]}]


# -- one line for every fault ----------------------------------------------------------------------

def _entry_fault(tmp_path, case: str) -> str:
    path = write_reward_file(tmp_path, REWARD_FILE)
    broken = write_reward_file(tmp_path, "import math\ndef f(:\n", "broken.py")
    raising = write_reward_file(tmp_path, "raise RuntimeError('no GPU here\\nsecond line')\n", "raising.py")
    return {"missing file": f"{tmp_path}/nope.py:exact",
            "syntax error": f"{broken}:f",
            "raises on import": f"{raising}:f",
            "no such name": f"{path}:exactly",
            "not callable": f"{path}:NOT_A_FUNCTION",
            "neither": "just-a-word"}[case]


@pytest.mark.parametrize("case, says", [
    ("missing file", "nope.py is not a file"),
    ("syntax error", "broken.py does not import: SyntaxError"),
    ("raises on import", "raising.py does not import: RuntimeError: no GPU here"),
    ("no such name", "has no 'exactly'"),
    ("not callable", "NOT_A_FUNCTION is a int, not a function"),
    ("neither", "just-a-word: neither FILE.py:NAME nor a reward model folder"),
])
def test_bad_entries_are_one_line_naming_them(tmp_path, case, says):
    entry = _entry_fault(tmp_path, case)
    with pytest.raises(InputError) as caught:
        RewardFunctions([entry])
    message = str(caught.value)
    assert "\n" not in message and says in message and entry in message


def _raises(completions, **kwargs):
    raise ValueError("cannot parse the answer\nmore detail")


def _short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def _text(completions, **kwargs):
    return ["1.0"] * len(completions)


def _scalar(completions, **kwargs):
    return 1.0


def _needs(completions, solution):
    return [0.0] * len(completions)


@pytest.mark.parametrize("function, says", [
    (_raises, "reward function _raises raised ValueError: cannot parse the answer at step 5"),
    (_short, "reward function _short returned 5 rewards for 6 completions at step 5 (one per "
             "completion)"),
    (_text, "reward function _text returned '1.0' (str) for completion 0 at step 5; a reward is a "
            "number or None"),
    (_scalar, "reward function _scalar returned a float at step 5, not a list of 6 rewards"),
    (_needs, "reward function _needs needs 'solution', which is not a column of the data set "
             "(its columns: answer, level)"),
])
def test_bad_answers_are_one_line_naming_function_and_step(function, says):
    prompts, completions, ids, _, columns = batch()
    with pytest.raises(InputError) as caught:
        RewardFunctions([function])(prompts, completions, ids, columns, step=5)
    assert str(caught.value) == says


def test_weights_default_to_one_and_must_match_the_functions():
    assert RewardFunctions([_short, _text]).weights.tolist() == [1.0, 1.0]
    with pytest.raises(InputError, match=r"^3 reward weights for 2 reward functions \(_short, _text\)"):
        RewardFunctions([_short, _text], weights=[1, 2, 3])
    with pytest.raises(InputError, match="each must be a number"):
        RewardFunctions([_short], weights=["heavy"])
    with pytest.raises(InputError, match="no reward function given"):
        RewardFunctions([])


# -- reward models ---------------------------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True], ids=["text", "conversation"])
@pytest.mark.parametrize("batch_size", [32, 4])
def test_reward_model_scores_equal_trl(reward_model, tmp_path, chat, batch_size):
    path = write_reward_file(tmp_path, REWARD_FILE)
    rewards = RewardFunctions([str(reward_model) + "/", f"{path}:length"], batch_size=batch_size)
    assert rewards.names == ["tiny-rm", "length"]  # TRL's: the folder's last part
    model, tokenizer = rewards.functions[0], rewards.tokenizers[0]
    assert not model.training and model.config.num_labels == 1
    assert tokenizer("a").input_ids[0] == tokenizer.bos_token_id  # the fixture's post-processor
    prompts, completions, ids, inputs, columns = batch(chat)
    ours = rewards(prompts, completions, ids, columns, step=2)
    theirs, _ = trl_rewards(rewards, inputs, prompts, completions, ids, step=2)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert ours[:, 0].std() > 0  # the scores depend on the text


def test_reward_model_given_as_a_module_with_its_tokenizer(reward_model):
    """A tokenizer without a pad token pads with end-of-sequence, and the model is told so."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_model)
    tokenizer.pad_token = None
    rewards = RewardFunctions([(model, tokenizer)])
    assert tokenizer.pad_token == tokenizer.eos_token and model.config.pad_token_id == tokenizer.eos_token_id
    prompts, completions, ids, inputs, columns = batch()
    theirs, _ = trl_rewards(rewards, inputs, prompts, completions, ids, step=0)
    torch.testing.assert_close(rewards(prompts, completions, ids, columns, 0), theirs, rtol=0, atol=1e-5)


def test_reward_model_faults_are_one_line(reward_model, tmp_path):
    causal = tiny_llama_folder(tmp_path / "causal")  # a causal LM: no score head
    with pytest.raises(InputError, match=r"^reward model .*causal holds a causal language model "
                                         r"\(LlamaForCausalLM\), a language model, without a score "
                                         r"head; give a sequence classifier's folder \(a reward model"):
        RewardFunctions([str(causal)])  # issue 39, item 9: not "has 2 labels"
    two = transformers.LlamaForSequenceClassification(tiny_llama_config(300, num_labels=2))
    two.save_pretrained(tmp_path / "two")
    transformers.AutoTokenizer.from_pretrained(reward_model).save_pretrained(tmp_path / "two")
    with pytest.raises(InputError, match=r"^reward model .*two: has 2 labels; a reward model has one"):
        RewardFunctions([str(tmp_path / "two")])
    with pytest.raises(InputError, match=r"^reward model .*empty: no config.json nor adapter_config.json in "):
        (tmp_path / "empty").mkdir()
        RewardFunctions([str(tmp_path / "empty")])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_model)
    tokenizer.chat_template = None
    prompts, completions, ids, _, columns = batch(chat=True)
    with pytest.raises(InputError, match="^reward model tiny-rm: the prompts are conversations and its "
                                         "tokenizer has no chat template$"):
        RewardFunctions([(model, tokenizer)])(prompts, completions, ids, columns, 0)


# -- the completions log ---------------------------------------------------------------------------

def test_completions_log_appends_one_line_per_completion(tmp_path):
    path = tmp_path / "out" / "completions.jsonl"
    path.parent.mkdir()
    path.write_text('{"from": "an earlier run"}\n')
    log = CompletionsLog(path)
    nan = math.nan
    per_func = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan]])
    log.write(4, ["p0", "p1", "p2"], ["c0", "c1", "c2"], torch.tensor([3, 1, 2]), per_func,
              ["reward", "reward"], [0.5, 2.0], torch.tensor([0.25, -0.5, 0.0]),
              extra={"level_seen": [7, 8, 9]})
    log.write(5, ["p"], [[{"role": "assistant", "content": "c"}]], [1], [[0.0, 1.0]], ["a", "b"],
              [1.0, 1.0], [0.0])
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"from": "an earlier run"}  # never truncated
    rows = [json.loads(line) for line in lines[1:]]
    assert rows[0] == dict(step=4, prompt="p0", completion="c0", completion_tokens=3, reward_2=1.0,
                           reward_3=2.0, level_seen=7, advantage=0.25, reward=0.5 * 1 + 2.0 * 2)
    assert rows[1]["reward_2"] is None and rows[1]["reward"] == 6.0  # NaN: null, left out of the sum
    assert rows[2]["reward"] is None and rows[2]["reward_3"] is None  # no function scored it
    assert rows[3]["completion"] == [{"role": "assistant", "content": "c"}] and rows[3]["b"] == 1.0
    assert isinstance(rows[0]["completion_tokens"], int) and len(rows) == 4
