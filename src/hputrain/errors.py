"""The one error type for bad input: the CLI prints its message as one line and exits 2."""


import difflib


def did_you_mean(word: str, choices, cutoff: float = 0.5, quote: bool = True) -> str:
    """" (did you mean 'X'?)" for the choice nearest to `word`, or "" when none is near."""
    near = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=cutoff)
    if not near:
        return ""
    return f" (did you mean {near[0]!r}?)" if quote else f" (did you mean {near[0]}?)"


def first_line(exc: BaseException) -> str:
    """The first line of `exc`'s message (its type's name when it has none): what a one-line
    error quotes of a library's exception."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class InputError(ValueError):
    """Bad input from the user (a flag, a config file, a checkpoint, a dataset, a device that is
    not there). The message names the problem; no traceback is shown."""


class EveryRankError(InputError):
    """Bad input that every rank of a job found alike, having agreed on it (an output_dir's
    checkpoints): rank 0 says its line, the other ranks end without a word."""
