"""This package's rendezvous errors as PyTorch's, where PyTorch's rendezvous is running.

torch's elastic agent and launchers catch ``torch.distributed.elastic.rendezvous``'s own
error classes (the agent ends a surplus node with "Rendezvous gracefully exited" when it
catches torch's ``RendezvousGracefulExitError``). When torch's rendezvous API module is
loaded, an error that this package's handlers raise is therefore re-classed, in place,
as a class deriving from both its own class and torch's class of the same name: code
catching either family catches it, and its message, cause and traceback stay as they
were. Such an error pickles as its own class, re-classed again where it is unpickled
if torch's rendezvous is loaded there. Without torch loaded nothing changes, and nothing
here imports torch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

from . import api

__all__ = ["TORCH_API_MODULE", "as_torch_error", "torch_errors"]

#: The module of torch's rendezvous error classes (looked up, never imported).
TORCH_API_MODULE = "torch.distributed.elastic.rendezvous.api"

#: This package's error classes, most specific first, that torch has classes of the same
#: name for.
_FAMILY: tuple[type[api.RendezvousError], ...] = (
    api.RendezvousGracefulExitError,
    api.RendezvousClosedError,
    api.RendezvousTimeoutError,
    api.RendezvousConnectionError,
    api.RendezvousStateError,
    api.RendezvousError,
)

_F = TypeVar("_F", bound=Callable[..., Any])


#: The classes made by ``_both``, one per pair (a race makes two alike: harmless).
_BOTH: dict[tuple[type[BaseException], type[BaseException]], type[BaseException]] = {}


def _both(ours: type[BaseException], theirs: type[BaseException]) -> type[BaseException]:
    """The class deriving from ``ours`` and ``theirs`` (one per pair), named as ours."""
    both = _BOTH.get((ours, theirs))
    if both is None:

        def reduce(self: BaseException) -> tuple[Any, ...]:
            # Pickled as ``ours`` (the pair's class is made at run time: pickle cannot
            # find it by name), re-classed again where the unpickling process has
            # torch's rendezvous loaded.
            return (_restore, (ours, self.args), self.__dict__ or None)

        namespace = {"__module__": ours.__module__, "__reduce__": reduce}
        both = type(ours.__name__, (ours, theirs), namespace)
        both.__qualname__ = ours.__qualname__
        both.__doc__ = ours.__doc__
        _BOTH[ours, theirs] = both
    return both


def _restore(ours: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    """Unpickle an error re-classed by :func:`as_torch_error`: ``ours(*args)``,
    re-classed as torch's too if torch's rendezvous is loaded here."""
    return as_torch_error(ours(*args))


def as_torch_error(exc: BaseException) -> BaseException:
    """``exc``, re-classed in place as torch's error too if it is one of this package's
    rendezvous errors and torch's rendezvous API is loaded; else ``exc`` unchanged.

    The new class derives from the error's own class and from torch's class of the same
    name (of its nearest base that torch has), so ``except`` clauses of either package
    match it.
    """
    torch_api = sys.modules.get(TORCH_API_MODULE)
    if torch_api is None or not isinstance(exc, api.RendezvousError):
        return exc
    for ours in _FAMILY:
        if not isinstance(exc, ours):
            continue
        theirs = getattr(torch_api, ours.__name__, None)
        if not isinstance(theirs, type) or not issubclass(theirs, BaseException):
            return exc
        if not isinstance(exc, theirs):
            both: Any = _both(type(exc), theirs)
            try:
                exc.__class__ = both
            except TypeError:  # a layout torch changed: leave the error as it is
                return exc
        return exc
    return exc


def torch_errors(method: _F) -> _F:
    """Decorate a handler method (or a handler creator) so that the rendezvous errors it
    raises are torch's too where torch's rendezvous is loaded (see :func:`as_torch_error`)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except api.RendezvousError as exc:
            as_torch_error(exc)
            raise

    return cast("_F", wrapper)
