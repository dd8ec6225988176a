"""Per-instance forwards: ``module.forward`` replaced on one module (the fast path's fused MLP and fused loss).

A bound method of a module-level function is what ``MethodType`` makes, but pickle stores a bound method as
``getattr(instance, function name)``, which the instance does not have: a model holding one could not be pickled.
[`InstanceForward`] is the same binding as a small picklable object; deepcopy and pickle bind the copy's forward to
the copy. It keeps ``__func__`` and ``__self__``, which code that wraps a module's forward (accelerate's mixed
precision wrapper) reads, and ``__wrapped__``, the forward it replaced, so that ``inspect.signature`` gives that
forward's parameters: the HF Trainer drops the batch columns a model's forward does not name, and ``generate``
validates its arguments the same way (with ``(*args, **kwargs)`` the Trainer dropped ``input_ids``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class InstanceForward:
    """``function(module, *args, **kwargs)``, callable as ``module.forward``, in place of ``replaced``."""

    __slots__ = ("__func__", "__self__", "__wrapped__")

    def __init__(self, function: Callable[..., Any], module: nn.Module, replaced: Callable[..., Any]):
        self.__func__ = function
        self.__self__ = module
        self.__wrapped__ = replaced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return InstanceForward, (self.__func__, self.__self__, self.__wrapped__)

    def __repr__(self) -> str:
        return f"<forward {self.__func__.__qualname__} of {type(self.__self__).__name__}>"


def set_instance_forward(module: nn.Module, function: Callable[..., Any]) -> None:
    """``module.forward = function`` bound to ``module`` (this instance only), with the signature of the forward it
    replaces."""
    module.forward = InstanceForward(function, module, module.forward)
