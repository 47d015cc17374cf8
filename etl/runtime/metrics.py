"""A stage's counts, typed: totals by name and the same counts broken down by one
dimension (a reason, a source, an export), instead of string keys to parse.

``Metrics({"accepted": 5, "rejected": 2}, by={"rejected": {"undecodable": 2}})`` reads
as a mapping of its totals (what the console line, the report's stage table and
`lakeshard runs` show); :attr:`Metrics.by` holds the breakdowns. The run ledger's
``inputs``/``outputs`` columns and the run's events keep both in one flat map,
``{"accepted": 5, "rejected": 2, "rejected:undecodable": 2}`` (:meth:`Metrics.as_map`),
which :meth:`Metrics.from_map` reads back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType

__all__ = ["Metrics", "SEP"]

# Between a breakdown's name and its key in the flat form: "rejected:undecodable".
SEP = ":"


class Metrics(Mapping[str, int]):
    """Totals by name (a read-only mapping) and breakdowns by one dimension (`by`:
    name -> key -> count). A total and a breakdown may share a name (``rejected`` and
    ``rejected`` by reason) or not (caption reports only ``status`` by status)."""

    __slots__ = ("_totals", "_by")

    def __init__(self, totals: Mapping[str, int] | None = None,
                 by: Mapping[str, Mapping[str, int]] | None = None) -> None:
        self._totals = {k: int(v) for k, v in (totals or {}).items()}
        self._by = {name: {str(k): int(v) for k, v in parts.items()}
                    for name, parts in (by or {}).items() if parts}
        for name in (*self._totals, *self._by):
            if SEP in name:
                raise ValueError(f"a metric's name cannot hold {SEP!r}: {name!r} (a "
                                 "breakdown goes in `by`)")

    def __getitem__(self, name: str) -> int:
        return self._totals[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._totals)

    def __len__(self) -> int:
        return len(self._totals)

    @property
    def by(self) -> Mapping[str, Mapping[str, int]]:
        return MappingProxyType({k: MappingProxyType(v) for k, v in self._by.items()})

    def part(self, name: str) -> dict[str, int]:
        """The breakdown `name` (``{}`` when there is none)."""
        return dict(self._by.get(name, {}))

    def as_map(self) -> dict[str, int]:
        """The flat form the ledger and the events keep: totals, then each breakdown's
        entries as ``name:key``."""
        return {**self._totals, **{f"{name}{SEP}{key}": n for name, parts in self._by.items()
                                   for key, n in parts.items()}}

    @classmethod
    def from_map(cls, flat: Mapping[str, int] | None) -> Metrics:
        """The inverse of :meth:`as_map` (a key splits at its first ``:``)."""
        totals: dict[str, int] = {}
        by: dict[str, dict[str, int]] = {}
        for key, n in (flat or {}).items():
            name, sep, part = key.partition(SEP)
            if sep:
                by.setdefault(name, {})[part] = n
            else:
                totals[name] = n
        return cls(totals, by)

    @classmethod
    def of(cls, value: Metrics | Mapping[str, int] | None) -> Metrics:
        """`value` as Metrics: a plain mapping is totals (a ``:`` in a name is refused)."""
        return value if isinstance(value, Metrics) else cls(value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Metrics):
            return self._totals == other._totals and self._by == other._by
        if isinstance(other, Mapping):
            return self.as_map() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, compared by value

    def __repr__(self) -> str:
        by = f", by={self._by!r}" if self._by else ""
        return f"Metrics({self._totals!r}{by})"
