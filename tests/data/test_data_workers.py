"""Data workers (dataloader_num_workers): the batches of a run without workers, bitwise and in
order, on every rank, across epochs and from a resumed step; a Trainer's resume with workers;
workers started by spawn (macOS, Windows), which receive the collator pickled; pinned memory (the
decisions on this CPU-only machine, the pinning itself where a GPU is)."""
import multiprocessing
import os
import pickle

import pytest
import torch

from hputrain import Trainer, TrainingArguments
from hputrain.data import batching as data_module
from hputrain.data import workers as loading
from hputrain.data.batching import (DropUnusedColumns, LoaderOptions, MicroBatches, PadToBuckets,
                                    default_collate, default_collator_for, to_device)
from hputrain.errors import InputError
from hputrain.models.gpt import GPT, GPTConfig
from hputrain.config.sections import DataSettings

from ..training.test_trainer import Regression, regression_data

needs_accelerator = pytest.mark.skipif(not torch.accelerator.is_available(),
                                       reason="pinning host memory needs an accelerator (GPU)")


class Samples(torch.utils.data.Dataset):
    """Map-style samples of random values; each says which process loaded it."""

    def __init__(self, n=37):
        g = torch.Generator().manual_seed(4)
        self.x = torch.randn(n, 5, generator=g)
        self.ids = torch.randint(0, 100, (n, 7), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "input_ids": self.ids[i], "index": i, "pid": os.getpid()}


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset that, like a Hugging Face IterableDataset, gives each worker its own
    share of the samples: with several workers the order could not be kept."""

    def __init__(self, n=30):
        self.samples = Samples(n)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, every = (0, 1) if info is None else (info.id, info.num_workers)
        return (self.samples[i] for i in range(first, len(self.samples), every))


def batches(dataset, workers, start_step=0, rank=0, world_size=2, epochs=3, **options):
    loader = LoaderOptions(workers, **options)
    micro = MicroBatches(dataset, default_collate, 3, accumulate=2, rank=rank, world_size=world_size,
                         seed=5, drop_last=False, loading=loader)
    return list(micro.iterate(start_step, epochs=epochs))


def assert_same_batches(with_workers, without):
    assert len(with_workers) == len(without) > 0
    for a, b in zip(with_workers, without):
        assert a.keys() == b.keys()
        for key in ("x", "input_ids", "index"):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("rank", [0, 1])
def test_workers_give_the_batches_of_a_run_without_workers(rank):
    """Several epochs, accumulate 2, rank `rank` of 2, the last global batch short (drop_last
    False): the same batches bitwise, in the same order, loaded in other processes."""
    dataset = Samples()
    without = batches(dataset, 0, rank=rank)
    with_workers = batches(dataset, 2, rank=rank, prefetch_factor=3)
    assert_same_batches(with_workers, without)
    pids = {int(p) for b in with_workers for p in b["pid"]}
    assert os.getpid() not in pids and len(pids) == 2  # both workers loaded, none in this process
    # 37 samples, 12 a step: the 4th step of an epoch has 1 sample, for rank 0 only
    per_epoch = 7 if rank == 0 else 6
    assert len(without) == 3 * per_epoch
    # the epochs differ in order: a worker that replayed epoch 0 would be caught above
    assert not torch.equal(without[0]["index"], without[per_epoch]["index"])


def test_resume_with_workers_gives_the_rest_of_an_uninterrupted_run():
    """From optimizer step k (mid-epoch, and a whole epoch later) with workers: exactly the
    micro-batches of an uninterrupted run without workers from step k on (36 samples: 3 whole
    steps an epoch, 2 micro-batches each)."""
    dataset = Samples(36)
    straight = batches(dataset, 0)
    for k in (2, 5):
        assert_same_batches(batches(dataset, 2, start_step=k), straight[2 * k:])


def test_iterable_dataset_is_read_by_one_worker_in_order():
    """An iterable dataset with num_workers=3: one worker reads the stream, so a dataset that
    splits itself among workers still gives the order of a run without workers; resume too."""
    dataset = Stream()
    without = batches(dataset, 0, epochs=2)
    with_workers = batches(dataset, 3, epochs=2)
    assert_same_batches(with_workers, without)
    assert len({int(p) for b in with_workers for p in b["pid"]}) == 1
    assert_same_batches(batches(dataset, 3, start_step=2, epochs=2), without[4:])


def test_an_input_error_in_a_worker_is_one_line():
    """default_collate's error on samples it cannot batch, raised in a worker, reaches the
    training process as the same one-line InputError (not the loader's traceback text)."""
    ragged = [{"x": torch.zeros(2, i + 1)} for i in range(6)]
    with pytest.raises(InputError) as error:
        batches(ragged, 2)
    assert str(error.value).startswith("cannot batch x of shapes") and "\n" not in str(error.value)

    class Empty(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])
    with pytest.raises(InputError, match="^the iterable train_dataset yielded no complete batch$"):
        batches(Empty(), 2)


def test_workers_draw_nothing_from_the_training_rng():
    """Starting workers seeds them from a generator of their own: the training process's RNG
    (dropout, initialisation) is where it would be without workers."""
    torch.manual_seed(11)
    before = torch.get_rng_state()
    batches(Samples(), 2, epochs=1)
    assert torch.equal(torch.get_rng_state(), before)


class Dropped(Regression):
    """Regression with dropout: its training draws from the global RNG every step."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x, y):
        return super().forward(self.drop(x), y)


def train(tmp_path, name, workers, resume=None):
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=8, save_steps=4, logging_steps=4,
                             learning_rate=1e-2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             disable_tqdm=True, dataloader_num_workers=workers, seed=3)
    model = Dropped()
    Trainer(model, args, train_dataset=regression_data(40)).train(resume_from_checkpoint=resume)
    return model


def test_trainer_with_workers_resumes_exactly(tmp_path):
    """40 samples, 8 per step: 5 steps an epoch. With 2 workers, 8 straight steps equal the run
    without workers, and 4 steps + a resume of 4 (across the epoch's end) equal 8 straight,
    weights bitwise."""
    straight = train(tmp_path, "straight", 2)
    reference = train(tmp_path, "no-workers", 0)
    resumed = train(tmp_path, "resumed", 2, resume=str(tmp_path / "straight" / "checkpoint-4"))
    for (name, p), q, r in zip(straight.named_parameters(), reference.parameters(), resumed.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), name
    assert not torch.equal(Dropped().net[0].weight, straight.net[0].weight)  # it did train


# -- workers started by spawn (macOS, Windows): the dataset and the collator travel pickled --------------

class Rows(torch.utils.data.Dataset):
    """regression_data's samples with a text column that no model takes, each saying which
    process loaded it."""

    def __init__(self, n=40):
        self.rows = regression_data(n)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {**self.rows[i], "text": f"row {i}", "pid": os.getpid()}


class SaysWhere(Dropped):
    def forward(self, x, y, pid):  # pid: which process loaded the samples (kept in the batch)
        return super().forward(x, y)


def spawned_run(tmp_path, name, workers):
    """8 steps (2 micro-batches each) of SaysWhere, every batch as the step received it."""
    seen = []

    def loss(module, batch):
        seen.append(batch)
        return module(**batch)["loss"]

    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=8, save_steps=0, logging_steps=4,
                             learning_rate=1e-2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             disable_tqdm=True, dataloader_num_workers=workers, seed=3, report_to="none")
    model = SaysWhere()
    trainer = Trainer(model, args, train_dataset=Rows(), compute_loss=loss)
    trainer.train()
    return trainer, model, seen


def test_workers_started_by_spawn_train_as_without_workers(tmp_path, monkeypatch):
    """As on macOS and Windows: the loader's workers are spawned, so the dataset and the Trainer's
    collator reach them pickled. The collator (data.DropUnusedColumns around default_collate)
    pickles without the Trainer, drops the text column in the workers, and a short run (40
    samples, 8 a step: across an epoch's end, with dropout) sees the batches of a run without
    workers, bitwise, and ends on the same weights."""
    starts = []

    def spawn():
        starts.append(1)
        return multiprocessing.get_context("spawn")

    monkeypatch.setattr(loading, "_start_method", spawn)
    trainer, reference, without = spawned_run(tmp_path, "no-workers", 0)
    collate = pickle.dumps(trainer._collate)
    assert b"Trainer" not in collate and len(collate) < 1000  # not the Trainer, its model, its optimizer
    _, model, spawned = spawned_run(tmp_path, "spawned", 2)
    assert starts == [1]  # one loader, started by spawn
    assert len(spawned) == len(without) == 16
    for a, b in zip(spawned, without):
        assert a.keys() == b.keys() == {"x", "y", "pid"}  # the text column dropped
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    assert {int(p) for b in spawned for p in b["pid"]}.isdisjoint({os.getpid()})  # loaded in the workers
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_the_default_collators_pickle():
    """default_collate, PadToBuckets (pad_to_multiple_of, length_buckets) and DropUnusedColumns
    around each come back from pickle and batch as before."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64))
    samples = [{"input_ids": torch.arange(n), "labels": torch.arange(n), "text": "t"} for n in (3, 7, 5)]
    settings = [{}, {"pad_to_multiple_of": 8}, {"length_buckets": 4}]
    collators = [default_collator_for(model, DataSettings.of(TrainingArguments(**s))) for s in settings]
    assert collators[0] is default_collate and all(isinstance(c, PadToBuckets) for c in collators[1:])
    for collate in collators:
        for original in (collate, DropUnusedColumns(collate, frozenset({"input_ids", "labels"}))):
            want, got = original(samples), pickle.loads(pickle.dumps(original))(samples)
            assert want.keys() == got.keys()
            for key, value in want.items():
                assert torch.equal(got[key], value) if torch.is_tensor(value) else got[key] == value, key
    batch = DropUnusedColumns(collators[2], frozenset({"input_ids", "labels"}))(samples)
    assert batch.keys() == {"input_ids", "labels"} and batch["input_ids"].shape == (3, 16)
    assert DropUnusedColumns(default_collate)(samples[:1])["text"] == ["t"]  # keep None: all kept


# -- pinned memory -------------------------------------------------------------------------------------

@pytest.fixture
def pins(monkeypatch):
    """A host that can pin (as with a GPU): pinning records the tensor's shape and marks it."""
    pinned = []

    def fake_pin(tensor):
        pinned.append(tuple(tensor.shape))
        out = tensor.clone()
        out.fake_pinned = True
        return out
    monkeypatch.setattr(data_module, "host_can_pin", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: getattr(t, "fake_pinned", False))
    return pinned


def test_non_blocking_copy_pins_host_tensors_first(pins):
    """A non-blocking copy to another device (the meta device stands for it) pins each host
    tensor not pinned yet; a blocking copy, a copy within the host, or an already pinned tensor
    is not pinned."""
    batch = {"a": torch.ones(2, 3), "b": [torch.zeros(4)], "text": ["x"]}
    out = to_device(batch, torch.device("meta"), non_blocking=True)
    assert sorted(pins) == [(2, 3), (4,)] and out["a"].is_meta and out["text"] == ["x"]
    pins.clear()
    to_device(batch, torch.device("meta"), non_blocking=False)
    to_device(batch, torch.device("cpu"), non_blocking=True)
    already = torch.ones(5)
    already.fake_pinned = True
    to_device(already, torch.device("meta"), non_blocking=True)
    assert pins == []


def test_no_pinning_where_the_host_cannot_pin(monkeypatch):
    """This CPU-only build cannot pin: a non-blocking copy goes ahead unpinned, no error."""
    monkeypatch.setattr(data_module, "host_can_pin", lambda: False)
    out = to_device({"a": torch.ones(2)}, torch.device("meta"), non_blocking=True)
    assert out["a"].is_meta


def test_batches_come_out_pinned_without_workers(pins):
    micro = MicroBatches(Samples(8), default_collate, 4, loading=LoaderOptions(pin_memory=True))
    out = list(micro.iterate(0, epochs=1))
    assert len(out) == 2 and all(b[k].is_pinned() for b in out for k in ("x", "input_ids", "index"))
    assert sorted(pins) == sorted([(4,), (4,), (4, 7), (4, 5)] * 2)  # index and pid are tensors too
    plain = list(MicroBatches(Samples(8), default_collate, 4).iterate(0, epochs=1))
    assert not any(b["x"].is_pinned() for b in plain)


@needs_accelerator
def test_batches_are_really_pinned_with_and_without_workers():
    for workers in (0, 2):
        out = batches(Samples(), workers, epochs=1, pin_memory=True)
        assert all(b["x"].is_pinned() for b in out)
    device = torch.accelerator.current_accelerator()
    moved = to_device({"x": torch.ones(3)}, device, non_blocking=True)
    assert moved["x"].device.type == device.type


def test_pin_keeps_the_batch_structure(pins):
    batch = {"a": torch.ones(1), "t": (torch.ones(2), "s"), "n": 3}
    out = data_module.pin(batch)
    assert out["t"][1] == "s" and out["n"] == 3 and out["a"].is_pinned() and out["t"][0].is_pinned()
