def install() -> int:
    """Redirects oneMKL's verbose timer to the vDSO clock in every loaded object; the slots
    redirected. Where no object was loaded or unloaded since the last walk of the relocation
    tables, points the slots that walk found again, without walking."""

def remove() -> int:
    """Puts oneMKL's own timer back; the slots restored."""

def slots() -> list[tuple[int, int, int]]:
    """(slot address, saved address, address in the slot now) of each redirected slot."""

def walks() -> int:
    """Relocation-table walks made in this address space (a forked child counts its parent's)."""
