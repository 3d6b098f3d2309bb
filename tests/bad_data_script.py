"""`hputrain train` whose data fails on one rank mid-run, for tests/checkpoint/test_resume.py: started by
`hputrain launch`, each process runs the command line's own entry (hputrain.cli.main) with ARGS,
after wrapping the batch source (data.batching.MicroBatches.iterate) so that rank RANK meets bad
input (InputError: a row that cannot be read) at its CALL-th micro-batch, while the other ranks
go on to the step's agreement. Each rank writes its pid to pid-RANK beside the output folder.

    bad_data_script.py RANK CALL train ARGS...
"""
import functools
import os
import sys

from hputrain.cli import main
from hputrain.data.batching import MicroBatches
from hputrain.errors import InputError

LINE = "--dataset rows.jsonl line {call}: rank {rank}'s row cannot be read, on purpose"


def fail_at(rank: str, call: int) -> None:
    original = MicroBatches.iterate

    @functools.wraps(original)
    def iterate(self, *args, **kwargs):
        for count, batch in enumerate(original(self, *args, **kwargs), 1):
            if count == call and os.environ.get("RANK", "0") == rank:
                raise InputError(LINE.format(call=call, rank=rank))
            yield batch

    MicroBatches.iterate = iterate


if __name__ == "__main__":
    rank, call, *argv = sys.argv[1:]
    output = argv[argv.index("--output-dir") + 1]
    with open(os.path.join(os.path.dirname(output), f"pid-{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))
    fail_at(rank, int(call))
    sys.exit(main(argv))
