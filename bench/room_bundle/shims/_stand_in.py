"""What every import stand-in of the room benchmark's bundle is made of (``make room-bundle``;
not installed anywhere else): a class that raises when made, naming the package and what is
missing, and a module ``__getattr__`` (PEP 562) that answers every name with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def stand_in(package: str, unavailable: str) -> tuple[type, Callable[[str], Any]]:
    """(the class, the module ``__getattr__``) of ``package``'s stand-in."""

    class Missing:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{package} is a stand-in in the room benchmark's bundle: "
                               f"{unavailable}")

        def __class_getitem__(cls, item: Any) -> Any:
            return cls

    def module_getattr(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing

    return Missing, module_getattr
