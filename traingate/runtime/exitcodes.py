"""Exit codes the runtime uses so a supervisor can tell causes apart without parsing logs."""

OK = 0
USER_ERROR = 64  # bad config or an exception in recipe code: do not retry
PREEMPTED = 75  # SIGTERM honoured: emergency checkpoint written, resume later (EX_TEMPFAIL)
DIVERGED = 76  # non-finite loss beyond the spec's tolerance: do not retry
TRANSIENT_IO = 77  # storage/network failure that outlived the in-process retries
DISK_FULL = 78  # a disk or quota is full: retrying writes to it again cannot help

NAMES = {
    OK: "ok",
    USER_ERROR: "user_error",
    PREEMPTED: "preempted",
    DIVERGED: "diverged",
    TRANSIENT_IO: "transient_io",
    DISK_FULL: "disk_full",
}
