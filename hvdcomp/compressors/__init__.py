"""Compression methods, one per module, each registered by name (see :func:`get_compressor`)."""
from .base import Compressor, Payload, rank, simulated_world, world_size
from .registry import available, compressor_class, get_compressor, parse_spec, register
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
from .powersgd import PowerSGDCompressor
from .gtopk import GlobalTopKCompressor
from .cltk import CyclicLeaderTopKCompressor
from .twophase import TwoPhaseCompressor
from .sidco import SIDCoCompressor
from .sbc import SBCCompressor
from .lowbit import LowBitCompressor
from .adaptive import AdaptiveCompressor

__all__ = ["Compressor", "Payload", "world_size", "rank", "simulated_world", "available", "compressor_class", "get_compressor", "parse_spec",
           "register", "NoneCompressor", "FP16Compressor", "BF16Compressor", "TopKCompressor",
           "RandomKCompressor", "ThresholdCompressor", "DGCCompressor", "QSGDCompressor",
           "TernGradCompressor", "SignSGDCompressor", "ScaledSignCompressor", "PowerSGDCompressor",
           "GlobalTopKCompressor", "CyclicLeaderTopKCompressor", "TwoPhaseCompressor", "SIDCoCompressor", "SBCCompressor",
           "LowBitCompressor", "AdaptiveCompressor"]
