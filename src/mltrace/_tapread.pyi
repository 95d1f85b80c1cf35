class Reader:
    """FdTap's reader loop in C, without the GIL (see ``_tapread.c``)."""

    draining: bool
    collecting: bool
    @property
    def forwarded_bytes(self) -> int: ...
    @property
    def forward_errors(self) -> int: ...
    @property
    def captured_lines(self) -> int: ...
    def __init__(
        self,
        read_fd: int,
        saved_fd: int,
        prefixes: tuple[bytes, ...],
        urgent: tuple[bytes, ...],
        hold_s: float,
        batch_s: float,
        max_line: int,
    ) -> None: ...
    def run(self) -> None:
        """Reads the pipe to its end, forwarding what is not captured; releases the GIL."""
    def take(self) -> list[tuple[int, bytes]]:
        """(receive ns, block of captured lines each ended by a newline) since the last take."""
    def restore(self, fd: int, merged_fd: int = -1, merged_saved: int = -1) -> bool:
        """Points ``fd`` at the saved descriptor again (and ``merged_fd`` at ``merged_saved``), then
        handles what is left in the pipe."""
