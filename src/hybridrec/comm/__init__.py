"""Communication: collectives with a byte ledger, codecs, gradient compressors."""

from hybridrec.comm.ledger import ByteCount, CommLedger, tensor_nbytes

__all__ = ["ByteCount", "CommLedger", "tensor_nbytes"]
