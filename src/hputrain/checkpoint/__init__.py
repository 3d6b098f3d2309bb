"""Checkpoints: save a run to `output_dir/checkpoint-STEP/`, resume it exactly, and export the
model as its library saves it. Each module owns one part, and imports only those listed after it:
- start.py: where a run starts in its output_dir (a checkpoint, or the beginning, with what an
  earlier run left set aside), decided by rank 0 for every rank;
- saving.py: `save_checkpoint` and `load_checkpoint`, which drive the rest, and `state_io_for`,
  which picks a state IO for a strategy;
- sharded.py: ShardedState, every rank's shards through torch.distributed.checkpoint, read
  through guarded readers, and `export_model` (`hputrain export`: shards to one file);
- full.py: FullState, the whole state written by rank 0, and the files a model with frozen
  parameters (a LoRA) adds;
- export.py: `save_model`, what `save_pretrained` writes (`Trainer.save_model`);
- state.py: StateIO, what a state IO does;
- host.py: the model's tensors on the host, each once, gathered where sharded;
- folder.py: the folder protocol (file names, a lock per output_dir, a temporary folder renamed
  into place, rotation, atomic writes) and CheckpointError;
- checks.py: checks of files from elsewhere before they are loaded.
"""
