"""What a training framework needs to run a thinwire optimizer correctly, framework-agnostic:

    from thinwire.integrations import keep_gradients_local, PerRankState
    keep_gradients_local(ddp_model)        # DDP (wrapped by the framework) all-reduces nothing
    state = PerRankState(optimizer)        # a checkpoint written by rank 0 holds every rank's state
    with CollectiveCounter().attribute(optimizer) as wire: ...   # every collective, by who issued it
    end_worker()                           # last in a torchrun worker: no abort at exit (shutdown.py)

Per framework, each importing only its own optional extra (loaded on first use):

    from thinwire.integrations import ThinwireTrainer        # transformers.Trainer   [hf]
    from thinwire.integrations import ThinwireDDPStrategy    # lightning.pytorch      [lightning]
    (Accelerate needs only the pieces above, and save_state / load_state / latest_complete:
     checkpoints that are complete or absent, accelerate_state.py; examples/accelerate_train.py)

Frameworks (Hugging Face Trainer, Accelerate, Lightning) wrap the model in DDP, which
all-reduces every gradient in backward, and save the optimizer's state from rank 0 only.
A thinwire optimizer then sends its compressed message *and* the dense gradient, and a
resumed run gives every rank rank 0's error feedback. `keep_gradients_local` and
`PerRankState` remove both through the hooks frameworks already offer: a DDP communication
hook, and an object with `state_dict` / `load_state_dict` that a framework checkpoints
beside the model (Accelerate's `register_for_checkpointing`, a Lightning callback's state,
a Trainer callback).
"""

from .accelerate_state import load_state, save_state
from .commit import latest_complete
from .ddp import keep_gradients_local, local_gradients_hook
from .shutdown import end_worker
from .state import PerRankState
from .wire import CollectiveCounter

# name -> the module that defines it; imported on first access, so `import thinwire.integrations`
# needs neither transformers nor lightning
_FRAMEWORKS = {"ThinwireTrainer": "hf_trainer", "ThinwireCallback": "hf_trainer",
               "ThinwireDDPStrategy": "lightning", "check_lightning_version": "lightning"}

__all__ = ["CollectiveCounter", "PerRankState", "end_worker", "keep_gradients_local", "latest_complete",
           "load_state", "local_gradients_hook", "save_state", *_FRAMEWORKS]


def __getattr__(name: str):
    if name in _FRAMEWORKS:
        import importlib
        return getattr(importlib.import_module(f".{_FRAMEWORKS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
