def install() -> int:
    """Redirects oneMKL's verbose timer to the vDSO clock in every loaded object; the slots redirected."""

def remove() -> int:
    """Puts oneMKL's own timer back; the slots restored."""

def slots() -> list[tuple[int, int, int]]:
    """(slot address, saved address, address in the slot now) of each redirected slot."""
