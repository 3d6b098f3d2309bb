"""`hputrain` with the device running out of memory, for tests/rehearsal/plan/test_out_of_memory.py: every
process (each rank, when `--devices N` relaunches this script under `hputrain launch`) makes
mark_step, which the Trainer calls after each micro-batch's backward and each optimizer step,
raise torch's OutOfMemoryError in step STEP's backward, as a GPU's allocator does.

    out_of_memory_script.py STEP train FLAG...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hputrain.accelerators.cpu import CPUAccelerator  # noqa: E402
from hputrain.cli import main  # noqa: E402


def run_out_of_memory_at(step: int, argv: list[str]) -> int:
    calls = {"n": 0}
    original = CPUAccelerator.mark_step

    def mark_step(self):
        calls["n"] += 1
        if calls["n"] == 2 * (step - 1) + 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return original(self)

    CPUAccelerator.mark_step = mark_step
    return main(argv)


if __name__ == "__main__":
    sys.exit(run_out_of_memory_at(int(sys.argv[1]), sys.argv[2:]))
