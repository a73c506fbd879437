"""A script whose first run wedges after a few steps (a dead NFS mount, a deadlocked data loader): it
prints, then sleeps and never prints again. Its second run completes."""
import os
import sys
import time

marker = os.path.join(sys.argv[1], "attempted")
first = not os.path.exists(marker)
open(marker, "a").close()
for step in range(1, 6):
    print(f"step {step} loss {1.0 / step:.3f}", flush=True)
    time.sleep(0.05)
    if first and step == 3:
        time.sleep(3600)
print("finished", flush=True)
