"""`hputrain config`: the defaults file, its questionnaire and what it sets in TrainingArguments."""
import io
import json
import os

import pytest

from hputrain.cli import Parser
from hputrain.config.arguments import TrainingArguments
from hputrain.cli.config import add_config_parser, ask
from hputrain.config.defaults import (LaunchDefaults, defaults_path, load_defaults, training_defaults,
                                      write_defaults)
from hputrain.errors import InputError

BUILT_IN = {"accelerator": "auto", "nproc_per_node": "auto", "num_nodes": 1,
            "mixed_precision": "no", "execution_mode": "auto"}


class Script:
    """A `read` that answers from a list, remembers the prompts and raises EOFError at the end."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.prompts = []

    def __call__(self, prompt):
        self.prompts.append(prompt)
        if not self.answers:
            raise EOFError
        return self.answers.pop(0)


def run_config(argv, monkeypatch=None, answers=None):
    """Parse `hputrain config ARGV` with our own parser and run it; `answers` become stdin lines."""
    parser = Parser(prog="hputrain")
    add_config_parser(parser.add_subparsers(dest="command", required=True, parser_class=Parser))
    args = parser.parse_args(["config", *argv])
    if answers is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{a}\n" for a in answers)))
    return args.func(args)


# -- where the file lives --------------------------------------------------------------------------

def test_defaults_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("HPUTRAIN_CONFIG_FILE", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert defaults_path() == tmp_path / "home/.config/hputrain/default_config.json"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert defaults_path() == tmp_path / "xdg/hputrain/default_config.json"
    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", str(tmp_path / "mine.json"))
    assert defaults_path() == tmp_path / "mine.json"


def test_load_and_write_use_defaults_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", str(tmp_path / "sub" / "d.json"))
    assert load_defaults() is None
    assert write_defaults(LaunchDefaults(num_nodes=2)) == tmp_path / "sub" / "d.json"
    assert load_defaults() == LaunchDefaults(num_nodes=2)


# -- the dataclass and the file --------------------------------------------------------------------

@pytest.mark.parametrize("values, words", [
    ({"accelerator": "gpu"}, "accelerator must be one of auto, hpu, cuda, mps, cpu"),
    ({"nproc_per_node": 0}, "nproc_per_node must be 'auto' or a positive whole number"),
    ({"nproc_per_node": "many"}, "nproc_per_node"),
    ({"num_nodes": True}, "num_nodes must be a positive whole number"),
    ({"mixed_precision": "fp16"}, "mixed_precision must be one of no, bf16"),
    ({"execution_mode": "lazzy"}, "did you mean 'lazy'?"),
])
def test_launch_defaults_validation(values, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace("?", r"\?")):
        LaunchDefaults(**values)


def test_write_is_json_with_indent_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "a" / "b" / "defaults.json"
    write_defaults(LaunchDefaults(accelerator="cpu", nproc_per_node=4), path)
    text = path.read_text()
    expected = {**BUILT_IN, "accelerator": "cpu", "nproc_per_node": 4}
    assert text == json.dumps(expected, indent=2) + "\n"
    assert os.listdir(path.parent) == ["defaults.json"]
    assert load_defaults(path) == LaunchDefaults(accelerator="cpu", nproc_per_node=4)


def test_write_replaces_the_old_file_whole(tmp_path):
    path = tmp_path / "d.json"
    path.write_text("x" * 10_000)
    write_defaults(LaunchDefaults(), path)
    assert json.loads(path.read_text()) == BUILT_IN


def test_load_missing_keys_take_the_defaults(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('{"num_nodes": 3}')
    assert load_defaults(path) == LaunchDefaults(num_nodes=3)


@pytest.mark.parametrize("text, words", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ('{"nproc_per_nod": 2}', "unknown key 'nproc_per_nod' in defaults file .* "
                             r"\(did you mean 'nproc_per_node'\?\)"),
    ('{"num_nodes": "2"}', "num_nodes must be a positive whole number; got '2'"),
    ('{"mixed_precision": "bf17"}', "mixed_precision must be one of no, bf16"),
])
def test_load_errors_name_the_file(tmp_path, text, words):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InputError, match=words) as info:
        load_defaults(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


# -- what the defaults set in TrainingArguments ----------------------------------------------------

def test_training_defaults_mapping():
    assert training_defaults(LaunchDefaults()) == {
        "accelerator": "auto", "num_nodes": 1, "bf16": False, "execution_mode": "auto"}
    chosen = LaunchDefaults(accelerator="cpu", nproc_per_node=2, num_nodes=3,
                            mixed_precision="bf16", execution_mode="eager")
    assert training_defaults(chosen) == {"accelerator": "cpu", "num_nodes": 3, "bf16": True,
                                         "execution_mode": "eager", "devices": 2}


@pytest.mark.parametrize("defaults", [
    LaunchDefaults(),
    LaunchDefaults(accelerator="hpu", nproc_per_node=8, num_nodes=2, mixed_precision="bf16",
                   execution_mode="lazy"),
])
def test_training_defaults_are_accepted_by_training_arguments(defaults):
    args = TrainingArguments(**training_defaults(defaults))
    for key, value in training_defaults(defaults).items():
        assert getattr(args, key) == value


# -- the questionnaire -----------------------------------------------------------------------------

def test_ask_five_questions_in_order_with_choices_and_defaults():
    read, lines = Script(["cpu", "2", "3", "bf16", "eager"]), []
    result = ask(LaunchDefaults(), read=read, write=lines.append)
    assert result == LaunchDefaults(accelerator="cpu", nproc_per_node=2, num_nodes=3,
                                    mixed_precision="bf16", execution_mode="eager")
    assert lines == []
    assert len(read.prompts) == 5
    assert "device" in read.prompts[0] and "auto/hpu/cuda/mps/cpu" in read.prompts[0]
    assert "processes per node" in read.prompts[1]
    assert "nodes" in read.prompts[2]
    assert "no/bf16" in read.prompts[3]
    assert "auto/eager/lazy/compile" in read.prompts[4]
    assert all(read.prompts[i].endswith("[auto]: ") for i in (0, 1, 4))
    assert read.prompts[2].endswith("[1]: ") and read.prompts[3].endswith("[no]: ")


def test_ask_empty_answers_keep_existing_values():
    existing = LaunchDefaults(accelerator="cuda", nproc_per_node=4, num_nodes=2,
                              mixed_precision="bf16", execution_mode="compile")
    read = Script(["", "  ", "", "", ""])
    assert ask(existing, read=read, write=print) == existing
    assert read.prompts[0].endswith("[cuda]: ") and read.prompts[1].endswith("[4]: ")


def test_ask_accepts_auto_and_any_case():
    read = Script(["HPU", "Auto", "", "BF16", ""])
    result = ask(LaunchDefaults(nproc_per_node=8), read=read, write=print)
    assert result == LaunchDefaults(accelerator="hpu", mixed_precision="bf16")


def test_ask_repeats_an_invalid_answer_and_says_why():
    read, lines = Script(["gpu", "cuda", "zero", "0", "2", "", "", ""]), []
    result = ask(LaunchDefaults(), read=read, write=lines.append)
    assert result == LaunchDefaults(accelerator="cuda", nproc_per_node=2)
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert "accelerator must be one of" in lines[0] and "'gpu'" in lines[0]
    assert "nproc_per_node" in lines[1] and "'zero'" in lines[1]
    assert "got 0" in lines[2]
    assert read.prompts[0] == read.prompts[1]  # the same question again


def test_ask_gives_up_after_three_bad_answers():
    read, lines = Script(["", "", "-1", "x", "1.5", "2"]), []
    with pytest.raises(InputError, match=r"no valid answer to 'How many nodes\?' after 3 tries"):
        ask(LaunchDefaults(), read=read, write=lines.append)
    assert len(lines) == 3
    assert read.answers == ["2"]  # no fourth try


def test_ask_without_input_points_to_default():
    with pytest.raises(InputError, match=r"no answer to .*hputrain config --default"):
        ask(LaunchDefaults(), read=Script(["cpu"]), write=print)


# -- the subcommand --------------------------------------------------------------------------------

def test_config_default_writes_built_in_values(tmp_path, capsys):
    path = tmp_path / "conf" / "d.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**BUILT_IN, "num_nodes": 4}))
    assert run_config(["--default", "--file", str(path)]) == 0
    assert json.loads(path.read_text()) == BUILT_IN
    assert capsys.readouterr().out == f"wrote {path}\n"


def test_config_default_uses_defaults_path(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HPUTRAIN_CONFIG_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert run_config(["--default"]) == 0
    path = tmp_path / "hputrain" / "default_config.json"
    assert json.loads(path.read_text()) == BUILT_IN
    assert capsys.readouterr().out == f"wrote {path}\n"


def test_config_asks_starting_from_the_existing_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "d.json"
    write_defaults(LaunchDefaults(accelerator="cuda", num_nodes=2), path)
    assert run_config(["--file", str(path)], monkeypatch, answers=["", "8", "", "bf16", ""]) == 0
    assert json.loads(path.read_text()) == {**BUILT_IN, "accelerator": "cuda", "nproc_per_node": 8,
                                            "num_nodes": 2, "mixed_precision": "bf16"}
    out = capsys.readouterr().out  # the prompts, then the report (no newline after a piped answer)
    assert "[cuda]: " in out and "[2]: " in out
    assert out.endswith(f"wrote {path}\n")


def test_config_without_input_writes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    with pytest.raises(InputError, match="--default"):
        run_config(["--file", str(path)], monkeypatch, answers=[])
    assert not path.exists()


def test_config_rejects_a_broken_existing_file(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    path.write_text('{"acelerator": "cpu"}')
    with pytest.raises(InputError, match="did you mean 'accelerator'"):
        run_config(["--file", str(path)], monkeypatch, answers=[""] * 5)
    assert path.read_text() == '{"acelerator": "cpu"}'


def test_config_unknown_flag_is_one_line_error():
    with pytest.raises(InputError, match="did you mean --default"):
        run_config(["--defualt"])
