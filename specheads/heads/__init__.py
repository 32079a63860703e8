"""Draft heads (plain nn.Modules, no I/O): EAGLE-3, EAGLE-1, MTP, P-EAGLE, DFlash."""
from .config import HeadConfig
from .eagle1 import Eagle1Head
from .dflash import DFlashHead
from .eagle3 import Eagle3Head
from .layers import StaticKVCache
from .mtp import MTPHead
from .peagle import PEagleHead
from .ttt import TTTCache, build_ttt_mask, ttt_forward

HEAD_CLASSES = {"eagle3": Eagle3Head, "eagle1": Eagle1Head, "mtp": MTPHead, "peagle": PEagleHead,
                "dflash": DFlashHead}


def build_head(cfg: HeadConfig):
    """Instantiate the head class for ``cfg.kind``."""
    return HEAD_CLASSES[cfg.kind](cfg)


__all__ = ["HeadConfig", "Eagle3Head", "Eagle1Head", "MTPHead", "PEagleHead", "DFlashHead", "StaticKVCache", "TTTCache",
           "build_ttt_mask", "ttt_forward", "build_head", "HEAD_CLASSES"]
