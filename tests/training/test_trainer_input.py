"""Bad input that reaches the training loop: one line (InputError), nothing new saved."""
import pytest

from hputrain import Trainer
from hputrain.errors import InputError

from ..training.test_trainer import Regression, args, regression_data


def test_a_diverging_loss_stops_at_once_and_saves_nothing_new(tmp_path):
    trainer = Trainer(Regression(), args(tmp_path, learning_rate=1e30, max_grad_norm=0.0, logging_steps=4,
                                         save_steps=2, max_steps=8), train_dataset=regression_data())
    with pytest.raises(InputError, match=r"loss became (nan|inf) between steps 1 and 2 .*without saving"):
        trainer.train()
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_a_batch_larger_than_the_data_set_is_one_line(tmp_path):
    trainer = Trainer(Regression(), args(tmp_path, per_device_train_batch_size=100, max_steps=3),
                      train_dataset=regression_data(64))
    with pytest.raises(InputError, match="smaller than one global batch"):
        trainer.train()


def test_resume_says_what_differs_and_which_value_wins(tmp_path, capsys):
    Trainer(Regression(), args(tmp_path, max_steps=4, save_steps=4), train_dataset=regression_data()).train()
    capsys.readouterr()
    changed = args(tmp_path, max_steps=6, per_device_train_batch_size=4, learning_rate=3e-2,
                   resume_from_checkpoint="latest")
    Trainer(Regression(), changed, train_dataset=regression_data()).train()
    out = capsys.readouterr().out
    assert "global batch of 4 samples where the checkpoint's run had 8: 4 wins" in out
    assert "learning_rate 0.03 where the checkpoint's run had 0.01: the checkpoint's wins" in out
