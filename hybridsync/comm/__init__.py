"""Dense collective backends, one module each (horovod.py, mpi.py), chosen by backend()."""
