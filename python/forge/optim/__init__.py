"""forge.optim: drop-in torch.optim optimizers whose updates run inside backward.

    opt = forge.optim.AdamW(model, lr=3e-4, weight_decay=0.1, state_format="int8")
    loss.backward()   # from the second step (mode="auto", a loop that reads no gradient):
                      # every parameter is updated here, as soon as its gradient is complete
    opt.step()        # completes the step: bookkeeping, and anything not yet updated
    opt.zero_grad()

Constructors take the nn.Module first, then torch.optim's own keyword names and defaults.
The public classes: rules.py. The optimizer they all are: optimizer.py, which names its parts
(how each parameter's update moves into backward: routing.py and backward.py). What it does
with each parameter: opt.summary() in words, opt.inspect() as data (summary.py).

Where the updates run (mode): "immediate" inside backward, so a loop that reads gradients
(clipping, GradScaler, a second backward) is refused there; "deferred" at step(), each fused
weight's gradient kept meanwhile as its X and dY or its dense dW in W's dtype, whichever is
smaller (torch.optim's contract); "auto" (the default) learns which at its first step
(docs/usage.md has the table). accumulate_grad=True keeps a plain dense .grad per parameter,
as torch.optim does.
"""
from .. import _lib

# Load libforge now: `import forge.optim` fails here, with the places it looked, when the
# library cannot be found (forge._lib.LibraryNotFound, an ImportError).
_lib.get()

from .optimizer import _ForgeOptimizer, param_groups_no_decay  # noqa: E402,F401 (isinstance)
from .capture import GraphCapture  # noqa: E402
from .deferred import ConsumedGrad, FactoredGrad  # noqa: E402
from .rules import SGD, Adagrad, Adam, AdamW, Lion, Muon, NAdam, RAdam, RMSprop  # noqa: E402
from .store import STATE_FORMATS  # noqa: E402
from .summary import Inspection, ParamInfo  # noqa: E402

__all__ = ["AdamW", "Adam", "NAdam", "RAdam", "Lion", "RMSprop", "Adagrad", "SGD", "Muon",
           "param_groups_no_decay", "GraphCapture", "FactoredGrad", "ConsumedGrad",
           "STATE_FORMATS", "Inspection", "ParamInfo"]
