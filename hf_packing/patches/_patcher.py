"""Reversible patches: each one is a record of (owner, attribute, replacement, original).

Applying twice is harmless (a record already applied is skipped) and revert puts back the very same
object that was there before, which the tests check with ``is``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_MISSING = object()


@dataclass
class Patch:
    """Set ``owner.<name>`` (or ``owner[name]`` for a mapping) to ``replacement``, remembering the original."""

    owner: Any
    name: str
    replacement: Any
    original: Any = field(default=_MISSING, init=False)

    def _is_mapping(self) -> bool:
        return isinstance(self.owner, dict)

    def _get(self) -> Any:
        if self._is_mapping():
            return self.owner.get(self.name, _MISSING)
        return (
            self.owner.__dict__.get(self.name, _MISSING)
            if isinstance(self.owner, type)
            else getattr(self.owner, self.name, _MISSING)
        )

    def _set(self, value: Any) -> None:
        if self._is_mapping():
            if value is _MISSING:
                self.owner.pop(self.name, None)
            else:
                self.owner[self.name] = value
        elif value is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, value)

    def apply(self) -> None:
        if self._get() is self.replacement:
            return
        self.original = self._get()
        self._set(self.replacement)

    def revert(self) -> None:
        if self._get() is self.replacement:
            self._set(self.original)
        self.original = _MISSING


class RegistryPatch(Patch):
    """Register ``replacement`` under ``name`` in a transformers ``GeneralInterface`` (e.g. ``AttentionInterface``)
    through its public ``register``; revert registers the original again."""

    def _get(self) -> Any:
        return self.owner().get(self.name, _MISSING)

    def _set(self, value: Any) -> None:
        self.owner.register(self.name, value)


class PatchSet:
    """Named groups of patches, applied and reverted as units, each with the options it was built with."""

    def __init__(self) -> None:
        self._groups: dict[str, tuple[list[Patch], Any]] = {}

    def active(self) -> list[str]:
        return list(self._groups)

    def is_applied(self, group: str) -> bool:
        return group in self._groups

    def options(self, group: str) -> Any:
        return self._groups[group][1] if group in self._groups else None

    def apply(self, group: str, patches: list[Patch], options: Any = None) -> None:
        if group in self._groups:
            return
        for patch in patches:
            patch.apply()
        self._groups[group] = (patches, options)

    def revert(self, group: str) -> None:
        patches, _ = self._groups.pop(group, ([], None))
        for patch in reversed(patches):
            patch.revert()
