"""A table whose rows have keys and change in place, sortable by any column and filterable.

Updating cells in place (instead of clearing and refilling) keeps the cursor, the scroll
position and the sort order where the operator left them. The sorted column's header
carries an arrow. As the table narrows, columns drop by priority, so it never scrolls
sideways; the key column (the first) never drops, and a key too long for it is cut in the
middle, so `long-doc-00017` and `long-doc-00018` stay apart. A column without a width is as
wide as its widest cell; a `fill` column takes the width left and wraps its cells onto more
lines. A sync that changes no row redraws nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import DataTable, Input, Static
from textual.widgets.data_table import ColumnKey

from console.tui.text import escaped, plain

CELL_PADDING = 2  # DataTable pads each cell by one column on either side
CHROME = 4  # the border, and the vertical scrollbar's room
FILL_MIN = 16  # a wrapped column narrower than this is more lines than words


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    width: int | None = None  # None: as wide as its widest cell
    drop: int = 0  # 0: always shown; else dropped when narrow, highest first, equals together
    fill: bool = False  # takes the width the others leave, its cells wrapped (one at most)


def middle_cut(text: str, width: int) -> str:
    """`text` in `width` columns, its middle replaced by an ellipsis when it does not fit:
    request ids differ at the end, where a tail cut would hide it."""
    if len(text) <= width:
        return text
    kept = width - 1
    head = (kept + 1) // 2
    return f"{text[:head]}…{text[len(text) - (kept - head):]}"


class KeyText(Text):
    """The key column's cell: what is shown (maybe cut) and the row key the sort reads."""

    def __init__(self, shown: str, key: str) -> None:
        super().__init__(shown)
        self.key = key


@dataclass(frozen=True)
class TableRow:
    key: str  # also the text of the first column, which the sort reads the key back from
    cells: tuple[str | Text, ...]
    sort_values: tuple[Any, ...]  # one comparable value per column; None sorts first
    haystack: str  # what the filter searches, lower case


class KeyedTable(Vertical):
    """A filter box over a DataTable; `sync(rows)` adds, updates and removes rows by key."""

    BINDINGS: ClassVar[list[BindingType]] = [
        # priority: the app runs it as the key arrives, so the keys typed right behind it
        # find the box focused (a table's own binding runs later, from the table's queue)
        Binding("slash", "filter", "Filter", priority=True),
        Binding("o", "next_sort", "Sort by"),
        Binding("O", "reverse_sort", "Reverse"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def __init__(self, columns: Sequence[Column], *, id: str | None = None,
                 sort_index: int = 0, reverse: bool = False, empty: str = "") -> None:
        super().__init__(id=id)
        self.columns = tuple(columns)
        self.empty = empty  # said under the header while no row is shown
        self.sort_index = sort_index
        self.reverse = reverse
        self.rows: dict[str, TableRow] = {}
        self._filter = ""
        self._shown: dict[str, tuple[Text, ...]] = {}
        self.shown_columns: tuple[int, ...] = tuple(range(len(self.columns)))  # indexes shown
        self._widths: dict[int, int] = {}  # the widths given to the DataTable's columns
        assert sum(c.fill for c in self.columns) <= 1, "one fill column at most"

    def compose(self) -> ComposeResult:
        box = Input(placeholder="filter (esc clears)", classes="table-filter")
        box.display = False  # hidden, and so out of the focus chain, until / opens it
        yield box
        yield Static(Text(self.empty, style="dim italic"), classes="table-empty")
        yield DataTable(cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        table = self.query_one(DataTable)
        for index in self.shown_columns:
            column = self.columns[index]
            table.add_column(self._label(index), key=column.key, width=self._widths.get(index))

    def _label(self, index: int) -> str:
        arrow = (" ▲", " ▼")[self.reverse] if index == self.sort_index else ""
        return f"{self.columns[index].label}{arrow}"

    def _natural(self, index: int) -> int:
        """The columns `index` needs: its width; else its widest cell, at least its label with
        the sort arrow; a fill column, at least FILL_MIN (it takes more when there is room)."""
        column = self.columns[index]
        if column.width is not None:
            return column.width
        label = len(column.label) + 2
        if column.fill:
            return max(label, FILL_MIN)
        cells = (row.cells[index] for row in self.rows.values())
        return max([label, *(len(cell) if isinstance(cell, str) else cell.cell_len
                             for cell in cells)])

    def fitting(self, width: int) -> tuple[tuple[int, ...], dict[int, int]]:
        """The columns that fit in `width` (those with the highest `drop` go first, columns
        sharing it together; one gone early comes back if what went later left it room), and
        each one's width: its natural width, the fill column's what the others leave."""
        visible = set(range(len(self.columns)))
        room = width - CHROME
        natural = {i: self._natural(i) for i in visible}

        def used() -> int:
            return sum(natural[i] + CELL_PADDING for i in visible)

        levels = sorted({c.drop for c in self.columns if c.drop}, reverse=True)
        dropped = []
        for level in levels:
            if used() <= room:
                break
            dropped.append({i for i, c in enumerate(self.columns) if c.drop == level})
            visible -= dropped[-1]
        for columns in reversed(dropped[:-1]):  # one dropped early may fit in the room left
            if used() + sum(natural[i] + CELL_PADDING for i in columns) <= room:
                visible |= columns
        widths = {i: natural[i] for i in visible}
        for index in visible:
            if self.columns[index].fill:
                widths[index] = max(natural[index], room - used() + natural[index])
        return tuple(sorted(visible)), widths

    def on_resize(self) -> None:
        self._refit()

    def _refit(self) -> bool:
        """Fit the columns to the table's width; True when they changed (and were rebuilt)."""
        if not self.size.width:
            return False  # not laid out yet: the first resize fits it
        visible, widths = self.fitting(self.size.width)
        if visible == self.shown_columns and widths == self._widths:
            return False
        self.shown_columns, self._widths = visible, widths
        self.table.clear(columns=True)
        self._shown = {}
        self._add_columns()
        self._apply(force=True)
        return True

    def _cells(self, row: TableRow) -> tuple[Text, ...]:
        """The row's cells for the visible columns as text (a str cell would be parsed as
        markup), the key column cut to its width."""
        first = row.cells[0]
        text = first.plain if isinstance(first, Text) else escaped(first)
        width = self.columns[0].width
        key_cell = KeyText(middle_cut(text, width) if width else text, row.key)
        return (key_cell, *(cell if isinstance(cell, Text) else plain(cell)
                            for cell in (row.cells[i] for i in self.shown_columns[1:])))

    @property
    def table(self) -> DataTable:
        return self.query_one(DataTable)

    def sync(self, rows: Sequence[TableRow]) -> None:
        self.rows = {row.key: row for row in rows}
        if not self._refit():
            self._apply()

    def _apply(self, force: bool = False) -> None:
        """Show the rows the filter keeps; the table is re-sorted and redrawn only when a row
        came, went or changed (or `force`): an idle engine's repeated rows cost nothing."""
        table = self.table
        wanted = {k: r for k, r in self.rows.items() if self._filter in r.haystack}
        changed = force
        for key in [k for k in self._shown if k not in wanted]:
            table.remove_row(key)
            del self._shown[key]
            changed = True
        columns = [self.columns[i] for i in self.shown_columns]
        wraps = any(column.fill for column in columns)
        for key, row in wanted.items():
            cells = self._cells(row)
            shown = self._shown.get(key)
            if shown == cells:
                continue
            changed = True
            if shown is not None and wraps:  # a wrapped row's height is measured as it is added
                table.remove_row(key)
                shown = None
            if shown is None:
                table.add_row(*cells, key=key, height=None if wraps else 1)
            else:
                for column, old, new in zip(columns, shown, cells, strict=True):
                    if old != new:
                        table.update_cell(key, column.key, new)
            self._shown[key] = cells
        if changed:
            self._sort()
            self._say_empty(bool(wanted))

    def _say_empty(self, rows_shown: bool) -> None:
        """Under the header while no row is shown: why, the filter's part included (a
        filter that hides every row is not an empty store)."""
        note = self.query_one(".table-empty", Static)
        hidden = len(self.rows)
        if rows_shown:
            note.display = False
        elif hidden:
            note.update(Text.assemble(
                f"none of the {hidden} row{'' if hidden == 1 else 's'} matches the filter ",
                (escaped(self._filter), "bold"), " · / edits it, Escape clears it",
                style="dim italic"))
            note.display = True
        else:
            note.update(Text(self.empty, style="dim italic"))
            note.display = bool(self.empty)

    def say_when_empty(self, text: str) -> None:
        """What the table says while it holds no row at all."""
        if text != self.empty:
            self.empty = text
            self._say_empty(bool(self._shown))

    def _sort(self) -> None:
        table = self.table
        for index in self.shown_columns:  # the arrow moves with the sort
            table.columns[ColumnKey(self.columns[index].key)].label = Text(self._label(index))
        if not self._shown:
            table.refresh()
            return
        index = self.sort_index

        def order(key_cell: KeyText) -> tuple[bool, Any]:
            value = self.rows[key_cell.key].sort_values[index]
            return (value is not None, value if value is not None else 0)

        table.sort(self.columns[0].key, key=order, reverse=self.reverse)

    def action_filter(self) -> None:
        """`/` opens the filter box (in the open box, the app types it as text first). Focus
        moves at once, not at the next idle moment as `focus()` would."""
        box = self.query_one(Input)
        box.display = True
        self.screen.set_focus(box)

    def action_clear_filter(self) -> None:
        box = self.query_one(Input)
        box.value = ""
        box.display = False
        self.screen.set_focus(self.table)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._filter = event.value.strip().lower()
        self._apply(force=True)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.screen.set_focus(self.table)

    def action_next_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(self.columns)
        self._sort()
        self.notify(f"sorted by {self.columns[self.sort_index].label}", timeout=1.5)

    def action_reverse_sort(self) -> None:
        self.reverse = not self.reverse
        self._sort()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        index = self.shown_columns[event.column_index]
        self.reverse = not self.reverse if index == self.sort_index else False
        self.sort_index = index
        self._sort()
