"""Horovod's PyTorch surface (horovod.torch 0.28.1's modules, by the same names): the job's basics,
the collectives and their autograd, process sets, object broadcasts, SyncBatchNorm, elastic and
gradient compression. hybridsync.torch re-exports every public name, and these modules are
importable under their Horovod paths too (`hybridsync.torch.mpi_ops`, ...)."""
