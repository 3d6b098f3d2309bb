"""The one error type for bad input: the CLI prints its message as one line and exits 2."""


class InputError(ValueError):
    """Bad input from the user (a flag, a config file, a checkpoint, a dataset, a device that is
    not there). The message names the problem; no traceback is shown."""
