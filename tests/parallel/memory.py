"""Peak resident memory of this rank, for the tests that bound what an operation costs."""
import resource


def peak_mib() -> float:
    """This process's lifetime (or, after reset_peak, this window's) peak RSS in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> float:
    """Starts a new peak-RSS window (Linux: clear_refs 5); the resident MiB now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak_mib()
