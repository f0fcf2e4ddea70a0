"""A --length-fn target for the pack tests (importable as ``helpers.tests_length_fn`` because tests/ is on sys.path)."""


def double_tokens(sample):
    return 2 * len(sample["tokens"])


def txt_words(sample):
    """For `shardtool index` tests: tar fields arrive as bytes."""
    return len(sample["txt"].split())
