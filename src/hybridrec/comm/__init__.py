"""Communication: collectives with a byte ledger, codecs, gradient compressors."""

from hybridrec.comm.exchange import ExchangeHandle, PairwiseExchange
from hybridrec.comm.ledger import ByteCount, CommLedger, tensor_nbytes

__all__ = ["ByteCount", "CommLedger", "ExchangeHandle", "PairwiseExchange", "tensor_nbytes"]
