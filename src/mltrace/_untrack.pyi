def untrack_span(span: object, /) -> bool:
    """Untracks a finished span, and its attributes' containers where none could be in a cycle;
    whether the whole attribute tree was untracked."""

def untrack_record(record: list[object], /) -> None:
    """Untracks a list of mltrace's own, which nothing else refers to, and the tuples in it."""
