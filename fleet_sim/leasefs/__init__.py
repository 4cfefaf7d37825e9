"""leasefs: a FUSE filesystem that gives each simulated host its own mount of one backing
directory and behaves like an NFSv4 client of a shared server (shared locks, partitions, lease
revocation, hung, read-only and vanished mounts).

Only the client side is imported here; the daemon (``python -m fleet_sim.leasefs mount``) is the
only part that loads libfuse.
"""

from fleet_sim.leasefs.control import LeaseFsControl, LeaseFsStatus
from fleet_sim.leasefs.errors import ControlError, FuseUnavailable, LeaseFsError, MountFailed
from fleet_sim.leasefs.mount import LeaseFsMount, check_fuse_available, mount_leasefs
from fleet_sim.leasefs.policy import Mode

__all__ = [
    "ControlError",
    "FuseUnavailable",
    "LeaseFsControl",
    "LeaseFsError",
    "LeaseFsMount",
    "LeaseFsStatus",
    "Mode",
    "MountFailed",
    "check_fuse_available",
    "mount_leasefs",
]
