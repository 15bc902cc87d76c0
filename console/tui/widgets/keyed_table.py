"""A table whose rows have keys and change in place, sortable by any column and filterable.

Updating cells in place (instead of clearing and refilling) keeps the cursor, the scroll
position and the sort order where the operator left them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import DataTable, Input


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    width: int | None = None


@dataclass(frozen=True)
class TableRow:
    key: str  # also the text of the first column, which the sort reads the key back from
    cells: tuple[str | Text, ...]
    sort_values: tuple[Any, ...]  # one comparable value per column; None sorts first
    haystack: str  # what the filter searches, lower case


class KeyedTable(Vertical):
    """A filter box over a DataTable; `sync(rows)` adds, updates and removes rows by key."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "filter", "Filter"),
        Binding("o", "next_sort", "Sort by"),
        Binding("O", "reverse_sort", "Reverse"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def __init__(self, columns: Sequence[Column], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.columns = tuple(columns)
        self.sort_index = 0
        self.reverse = False
        self.rows: dict[str, TableRow] = {}
        self._filter = ""
        self._shown: dict[str, tuple[str | Text, ...]] = {}

    def compose(self) -> ComposeResult:
        box = Input(placeholder="filter (esc clears)", classes="table-filter")
        box.display = False  # hidden, and so out of the focus chain, until / opens it
        yield box
        yield DataTable(cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for column in self.columns:
            table.add_column(column.label, key=column.key, width=column.width)

    @property
    def table(self) -> DataTable:
        return self.query_one(DataTable)

    def sync(self, rows: Sequence[TableRow]) -> None:
        self.rows = {row.key: row for row in rows}
        self._apply()

    def _apply(self) -> None:
        table = self.table
        wanted = {k: r for k, r in self.rows.items() if self._filter in r.haystack}
        for key in [k for k in self._shown if k not in wanted]:
            table.remove_row(key)
            del self._shown[key]
        for key, row in wanted.items():
            shown = self._shown.get(key)
            if shown is None:
                table.add_row(*row.cells, key=key)
            elif shown != row.cells:
                for column, old, new in zip(self.columns, shown, row.cells, strict=True):
                    if old != new:
                        table.update_cell(key, column.key, new)
            self._shown[key] = row.cells
        self._sort()

    def _sort(self) -> None:
        if not self._shown:
            return
        index = self.sort_index

        def order(key_cell: str) -> tuple[bool, Any]:
            value = self.rows[str(key_cell)].sort_values[index]
            return (value is not None, value if value is not None else 0)

        self.table.sort(self.columns[0].key, key=order, reverse=self.reverse)

    def action_filter(self) -> None:
        box = self.query_one(Input)
        box.display = True
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one(Input)
        box.value = ""
        box.display = False
        self.table.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._filter = event.value.strip().lower()
        self._apply()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.table.focus()

    def action_next_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(self.columns)
        self._sort()
        self.notify(f"sorted by {self.columns[self.sort_index].label}", timeout=1.5)

    def action_reverse_sort(self) -> None:
        self.reverse = not self.reverse
        self._sort()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        index = event.column_index
        self.reverse = not self.reverse if index == self.sort_index else False
        self.sort_index = index
        self._sort()
