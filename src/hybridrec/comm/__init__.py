"""Communication: collectives with a byte ledger, codecs, gradient compressors."""

from hybridrec.comm.compress import (
    CastCompressor,
    DCTCompressor,
    GradientCompressor,
    NoCompression,
    TopKCompressor,
)
from hybridrec.comm.exchange import ExchangeHandle, PairwiseExchange
from hybridrec.comm.ledger import ByteCount, CommLedger, tensor_nbytes
from hybridrec.comm.sparse_message import SparseGrad

__all__ = ["ByteCount", "CastCompressor", "CommLedger", "DCTCompressor", "ExchangeHandle",
           "GradientCompressor", "NoCompression", "PairwiseExchange", "SparseGrad", "TopKCompressor",
           "tensor_nbytes"]
