"""Expert-parallel token exchange: ``Buffer.dispatch`` / ``Buffer.combine`` and the functional
``torch.ops.ditron.moe_dispatch`` / ``moe_dispatch_cached`` / ``moe_combine`` ops (see
``buffer``)."""
from . import reference
from .buffer import (LAYOUTS, Buffer, MoEDispatch, MoEError, MoEHandle, MoEInputError,
                     MoEOverflowError)
from . import _ops  # noqa: E402,F401  (defines the torch ops and their autograd)

__all__ = ["Buffer", "MoEDispatch", "MoEHandle", "MoEError", "MoEInputError", "MoEOverflowError",
           "LAYOUTS", "reference"]
