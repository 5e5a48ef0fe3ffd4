"""Page-table rows: one per admitted request."""

from __future__ import annotations


class TableManager:
    """Hands out page-table row indices; lowest free row first."""

    def __init__(self, num_rows: int) -> None:
        self._free = list(range(num_rows - 1, -1, -1))
        self.num_rows = num_rows

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        assert 0 <= row < self.num_rows and row not in self._free, row
        self._free.append(row)
