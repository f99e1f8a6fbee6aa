"""The staged executor: transfers through registered bounce buffers (see ``stager``)."""

from kvplan_nixl.staged.stager import DEFAULT_COSTS, SERVE_TIMEOUT, Stager
from kvplan_nixl.staged.transfer import MixedTransfer, StagedTransfer

__all__ = ["DEFAULT_COSTS", "SERVE_TIMEOUT", "MixedTransfer", "StagedTransfer", "Stager"]
