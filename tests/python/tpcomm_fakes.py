"""Stand-ins for torch functions laid out otherwise (tests of tpcomm's hooks)."""


def without_group(torchs):
    """`torchs` behind a function that takes (*args, **kwargs): no `group`
    argument in its signature, the same behaviour."""

    def collective(*args, **kwargs):
        return torchs(*args, **kwargs)

    collective.__name__ = torchs.__name__
    return collective
