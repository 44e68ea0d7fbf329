"""Errors that speak to the user: what was wrong, with which input, and what to do."""


class StrataError(Exception):
    """A problem with the user's input (a file, a setting, a prompt). The CLI prints it and exits 2."""


class CheckpointError(StrataError):
    """A checkpoint that is missing, truncated, of an unknown architecture or with a malformed tensor."""


class PromptTooLong(StrataError):
    """A prompt (plus the tokens asked for) that does not fit in a sequence's `max_cells`."""
