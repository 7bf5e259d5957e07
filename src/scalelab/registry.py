"""Name -> class registries (workloads, strategies, commands): no if/elif chains on names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from scalelab.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    """A dict of named entries, each with a one-line description, filled by a decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._descriptions: dict[str, str] = {}

    def register(self, name: str, description: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            if isinstance(entry, type):
                entry.name = name  # a registered class knows the name it runs under
            self._entries[name] = entry
            self._descriptions[name] = description
            return entry

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries))
            raise UsageError(f"unknown {self.kind} {name!r} (known: {known})") from None

    def unregister(self, name: str) -> None:
        """Drop an entry (a test that registered a plugin puts the registry back)."""
        self._entries.pop(name, None)
        self._descriptions.pop(name, None)

    def describe(self, name: str) -> str:
        return self._descriptions[name]

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
