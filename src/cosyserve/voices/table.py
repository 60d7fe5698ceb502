"""The queries every SQL voice store shares: one table of :data:`~cosyserve.voices.rows.COLUMNS`,
read and deleted by name, whatever database and connection handling run them."""

import copy
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from cosyserve.pipeline.voice import VoicePrompt, check_voice_name
from cosyserve.voices.rows import COLUMN_LIST, INFO_COLUMN_LIST, info_from_row, voice_from_row
from cosyserve.voices.store import DEFAULT_FAMILY, FAMILY_NAME, VoiceInfo, VoiceStore

Row = Sequence[Any]


class TableVoiceStore(VoiceStore):
    """A :class:`VoiceStore` over one SQL table. A subclass names its table, its parameter
    marker and its ordering by name, runs statements (:meth:`_fetch_one`, :meth:`_fetch_all`,
    :meth:`_write`, each turning database failures into
    :class:`~cosyserve.voices.store.VoiceStoreError`) and stores voices (``put``)."""

    _table: str  # the class's: DEFAULT_FAMILY's voices; a family view's: "<that>_<family>"
    _param: ClassVar[str]  # the driver's parameter marker: "?" or "%s"
    _by_name: ClassVar[str]  # the ORDER BY clause that sorts names by code point
    # The store that owns the connections: itself, unless this is a for_family view.
    _root: Self | None = None

    @property
    def _owner(self) -> Self:
        return self if self._root is None else self._root

    @abstractmethod
    def _ensure_table(self, table: str) -> None:
        """Create ``table`` (the voices columns) if it is missing, else check its columns."""

    def for_family(self, family: str) -> VoiceStore:
        if family == DEFAULT_FAMILY:
            return self
        if not FAMILY_NAME.fullmatch(family):
            raise ValueError(f"invalid model family name {family!r}")
        owner = self._owner
        table = f"{type(self)._table}_{family}"
        owner._ensure_table(table)
        view = copy.copy(owner)  # the connection, its lock and state are shared, not copied
        view._table = table
        view._root = owner
        return view

    @abstractmethod
    def _fetch_one(self, query: str, params: Sequence[object]) -> Row | None:
        """The first row of ``query``, or None."""

    @abstractmethod
    def _fetch_all(self, query: str) -> list[Row]:
        """Every row of ``query``."""

    @abstractmethod
    def _write(self, query: str, params: Sequence[object]) -> int:
        """Run the write ``query``; the number of rows it changed."""

    def get(self, name: str) -> VoicePrompt | None:
        row = self._named(COLUMN_LIST, name)
        return None if row is None else voice_from_row(row)

    def info(self, name: str) -> VoiceInfo | None:
        row = self._named(INFO_COLUMN_LIST, name)
        return None if row is None else info_from_row(row)

    def delete(self, name: str) -> bool:
        check_voice_name(name)
        return self._write(f"DELETE FROM {self._table} WHERE name = {self._param}", (name,)) > 0

    def names(self) -> list[str]:
        return [str(row[0]) for row in self._fetch_all(f"SELECT name FROM {self._table} {self._by_name}")]

    def list_info(self) -> list[VoiceInfo]:
        rows = self._fetch_all(f"SELECT {INFO_COLUMN_LIST} FROM {self._table} {self._by_name}")
        return [info_from_row(row) for row in rows]

    def _named(self, columns: str, name: str) -> Row | None:
        check_voice_name(name)
        return self._fetch_one(f"SELECT {columns} FROM {self._table} WHERE name = {self._param}", (name,))
