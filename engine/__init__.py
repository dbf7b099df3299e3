import os

__version__ = "0.1.0"

# Before torch loads OpenMP: threads that sleep at once instead of spinning. On an idle machine the
# difference is within run-to-run noise; as soon as another program takes a core, spinning threads
# wait on descheduled ones (demo, 2 cores, one busy: 5.2-6.7 -> 15.4-16.0 tok/s). A user's setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
