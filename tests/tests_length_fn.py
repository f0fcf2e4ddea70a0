"""A --length-fn target for the pack tests (importable because tests/ is on sys.path)."""


def double_tokens(sample):
    return 2 * len(sample["tokens"])
