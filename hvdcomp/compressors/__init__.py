"""Per-tensor compression methods, one per module, each registered by name
(:func:`hvdcomp.get_compressor`). Step-wide methods (PowerSGD, gtopk, cltk, twophase) live with
their transport in :mod:`hvdcomp.transports`."""
from .base import Compressor, Method, Payload, PayloadKind, rank, simulated_world, world_size
from .registry import available, compressor_class, create, register
from .none import NoneCompressor
from .fp16 import FP16Compressor
from .bf16 import BF16Compressor
from .topk import TopKCompressor
from .randomk import RandomKCompressor
from .threshold import ThresholdCompressor
from .dgc import DGCCompressor
from .qsgd import QSGDCompressor
from .terngrad import TernGradCompressor
from .signsgd import SignSGDCompressor, ScaledSignCompressor
from .sidco import SIDCoCompressor
from .sbc import SBCCompressor
from .lowbit import LowBitCompressor
from .adaptive import AdaptiveCompressor

__all__ = ["Compressor", "Method", "Payload", "PayloadKind", "world_size", "rank", "simulated_world", "available",
           "compressor_class", "create", "register", "NoneCompressor", "FP16Compressor", "BF16Compressor",
           "TopKCompressor", "RandomKCompressor", "ThresholdCompressor", "DGCCompressor", "QSGDCompressor",
           "TernGradCompressor", "SignSGDCompressor", "ScaledSignCompressor", "SIDCoCompressor", "SBCCompressor",
           "LowBitCompressor", "AdaptiveCompressor"]
