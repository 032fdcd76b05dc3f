"""Stand-ins for torch functions laid out otherwise (tests of tpcomm's hooks)."""


def without_group(torchs):
    """`torchs` behind a function that takes (*args, **kwargs): no `group`
    argument in its signature, the same behaviour."""

    def collective(*args, **kwargs):
        return torchs(*args, **kwargs)

    collective.__name__ = torchs.__name__
    return collective


def logged(func):
    """`func` inside a wrapper laid out as torch's error logger (a closure
    over `func`, with __wrapped__)."""
    import functools

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper
